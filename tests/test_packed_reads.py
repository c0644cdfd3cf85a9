"""The LLM's packed reads (core/layouts/packed.py, core/fast/packed_reads.py): one flat forward over any slots' new
tokens, padded to a bucket of their total, each token attending its own slot, logits only where asked — equal to a
plain forward of each row alone; and served rows whose LLM reads are packed (their prompts' pieces riding in them)
answer what ``generate`` answers alone, under every policy, speculating or not."""

import dataclasses
import random

import pytest
import torch

from r2r_hf.core.fast.fused_reads import PLAIN
from r2r_hf.core.fast.packed_reads import PackedSteps
from r2r_hf.core.fast.slot_reads import capture_slots
from r2r_hf.core.layouts.packed import GROUPS, layout, pack, shapes
from r2r_hf.core.layouts.slot_cache import SlotCache
from r2r_hf.core.policy import WaitPolicy
from r2r_hf.testing.graphs import EmulatedGraphStep
from test_batching import PROMPTS, Driver, _alone, _threshold


def test_a_plan_lays_each_row_out_in_its_own_attention_row_and_pads_the_total_only():
    plan = pack([2, 0], [5, 3], [3, 1], [(2, 7), (0, 3)], kept=4)
    assert (plan.width, plan.group, plan.keep, plan.real) == (4, 4, (2, 3), 4)
    host = layout(plan, slots=4, capacity=10, trash=10)
    assert host["slot"].tolist() == [2, 2, 2, 0] and host["column"].tolist() == [5, 6, 7, 3]
    assert host["place"].tolist() == [8, 9, 10, 0], "row r's j-th token at r * group + j"
    assert host["qpos"].view(4, 4)[2].tolist() == [5, 6, 7, -1] and host["keep"].tolist() == [2, 3, 0, 0]
    padded = pack([1], [0], [7], [], kept=2)
    assert padded.width == 8 and layout(padded, 2, 10, 10)["column"].tolist()[7:] == [10], "padding: the trash column"
    with pytest.raises(ValueError, match="at most 64 tokens of a row"):
        pack([0], [0], [65], [], kept=1)


@pytest.mark.parametrize("slots", [16, 65, 256, 1000])
def test_every_plan_of_a_server_has_a_shape_it_captured(slots):
    """Any number of slots (issue 59, item 1: the buckets ended at 64 slots x 64 tokens, and 65 slots failed at
    start-up): every plan, the largest (every slot reading its most) included, has a shape its server captures."""
    rng = random.Random(0)
    captured = set(shapes(slots))
    for _ in range(300):
        rows = rng.sample(range(slots), rng.randint(1, slots))
        counts = [rng.choice([1, 1, 2, 3, 5, 9, 17, 40, 64]) for _ in rows]
        plan = pack(rows, [0] * len(rows), counts, [], kept=slots)
        assert (plan.width, plan.group) in captured, (counts, plan.width, plan.group)
    largest = pack(list(range(slots)), [0] * slots, [GROUPS[-1]] * slots, [], kept=slots)
    assert (largest.width, largest.group) == max(captured) and largest.width >= slots * GROUPS[-1]
    assert largest.width <= 1.5 * slots * GROUPS[-1], "a bucket pads by half its tokens at most"
    if slots == 16:
        assert len(captured) == 43


def test_a_packed_read_gives_each_row_what_a_plain_forward_of_it_alone_gives(llm):
    torch.manual_seed(0)
    slots, capacity = 4, 48
    tokens = torch.randint(3, 300, (slots, capacity))
    reads = PackedSteps(llm, SlotCache(llm.config.num_hidden_layers, slots, capacity), PLAIN, {False: 4, True: 16})

    def alone(row: int, end: int) -> torch.Tensor:
        return llm(input_ids=tokens[row : row + 1, :end]).logits[0]

    seen = [0] * slots
    rng = random.Random(1)
    with torch.no_grad():
        for _ in range(6):  # reads of random rows, each from where the last stopped, logits at random positions
            rows = sorted(rng.sample(range(slots), rng.randint(1, slots)))
            counts = [rng.randint(1, 9) for _ in rows]
            wanted = [(r, seen[r] + rng.randrange(n)) for r, n in zip(rows, counts)]
            got = reads.read(tokens, pack(rows, [seen[r] for r in rows], counts, wanted, kept=16))
            want = torch.stack([alone(r, c + 1)[c] for r, c in wanted])
            assert torch.allclose(got, want, atol=1e-4), (rows, counts)
            for r, n in zip(rows, counts):
                seen[r] += n


def _packed(run: Driver, speculate: int = 0) -> Driver:
    """``run``'s slots captured on emulated graphs, the LLM's reads packed (the fused regions run plain)."""
    pool = EmulatedGraphStep.new_pool(torch.device("cpu"))
    report = capture_slots(run.batch.layout, lambda fn, example: EmulatedGraphStep(fn, example, pool), warm=False,
                           fuse="plain", speculate=speculate)
    assert report["packed"]
    return run


@pytest.mark.parametrize("policy", [WaitPolicy((1,), 1), WaitPolicy((3,), 8), WaitPolicy((3,), 8, speculate=4),
                                    WaitPolicy((2,), 32, speculate=2)],
                         ids=["m1", "m3-w8", "speculating", "speculating-w32"])
def test_rows_whose_llm_reads_are_packed_answer_what_generate_answers_alone(model, tok, policy):
    """Rows join mid-way with prompts read over several turns (chunked prefill: their LLM pieces ride in the LLM's
    reads), route, wait, speculate and roll back; greedy and seeded."""
    tau = _threshold(model, tok, 0.6)
    run = _packed(Driver(model, tok, slots=4, policy=policy, capacity=96, prefill=4), policy.speculate)
    jobs = {i: {"max_new_tokens": 10 + i, "threshold": tau, "do_sample": i % 2 == 1,
                **({"seed": 5 + i, "temperature": 1.0} if i % 2 else {})} for i in range(6)}
    for i in range(3):
        run.join(i, i, **jobs[i])
    run.run(steps=5)
    for i in range(3, 6):  # joining while the others decode, into the slots the first ones leave
        while run.batch.ledger.free_slots() == 0:
            run.run(steps=1)
        run.join(i, i, **jobs[i])
    run.run()
    for i in range(6):
        assert run.out[i] == _alone(model, tok, i, **jobs[i]), i
    counters = run.batch.counters
    assert counters.llm_tokens > 0 and (not policy.speculate or counters.agreed + counters.rejected > 0)
    assert counters.llm_rows_real <= counters.llm_rows_read


def test_a_joining_prompt_rides_in_the_llms_next_read(model, tok):
    """Row 1's prompt is read in 2-token pieces; where the LLM reads row 0 in that turn, row 1's piece is in the same
    forward (one LLM forward, two rows), not in one of its own."""
    run = _packed(Driver(model, tok, slots=2, policy=WaitPolicy((1,), 1), capacity=64, prefill=2))
    run.join(0, 0, max_new_tokens=12, threshold=0.0)  # every token routed: the LLM reads row 0 at every step
    run.run(steps=2)
    run.batch.counters.shapes = []
    run.join(1, PROMPTS[1], max_new_tokens=4, threshold=0.0)
    run.run(steps=3)
    llm = [shape for shape in run.batch.counters.shapes if shape[0] == "llm"]
    assert llm and all(rows == 2 for _, rows, _ in llm[:3]), llm
    assert len(llm) == 3, "one LLM forward per turn: row 1's pieces rode in row 0's reads"


def test_the_router_scores_greedy_rows_inside_the_slms_read(model, tok):
    """The router folded into the server's SLM reads (``fast/router_copy.folded``): greedy rows without processors
    are scored in the captured SLM read that gave their logits, with no router step of their own; a sampled row's
    proposal exists only after its draw, so it is scored by the router step. Answers are ``generate``'s alone."""
    tau = _threshold(model, tok, 0.6)
    for sampled, steps_wanted in ((False, 0), (True, None)):
        run = _packed(Driver(model, tok, slots=2, policy=WaitPolicy((2,), 4), capacity=64))
        router_calls = []
        layout = run.batch.layout
        step = layout.path.route
        layout.use(dataclasses.replace(layout.path, route=lambda *args: (router_calls.append(1), step(*args))[1]))
        options = {"max_new_tokens": 10, "threshold": tau, "do_sample": sampled,
                   **({"seed": 3, "temperature": 1.0} if sampled else {})}
        for i in range(2):
            run.join(i, i, **options)
        run.run()
        for i in range(2):
            assert run.out[i] == _alone(model, tok, i, **options), (sampled, i)
        assert (len(router_calls) == 0) if steps_wanted == 0 else len(router_calls) > 0, sampled


def test_a_server_of_65_slots_captures_its_packed_reads_at_start_up(model, tok):
    """Issue 59, item 1 as it was found: 65 slots or more died at start-up ("generator raised StopIteration")."""
    run = Driver(model, tok, slots=65, policy=WaitPolicy((1,), 1), capacity=32)
    pool = EmulatedGraphStep.new_pool(torch.device("cpu"))
    with torch.inference_mode():
        report = capture_slots(run.batch.layout, lambda fn, example: EmulatedGraphStep(fn, example, pool), warm=True,
                               fuse="plain")
    widths = {width for width, *_ in run.batch.layout.path.llm.steps.steps}
    assert report["packed"] and max(widths) == pack(list(range(65)), [0] * 65, [64] * 65, [], kept=65).width == 6144


@pytest.mark.parametrize("policy", [WaitPolicy((1,), 1), WaitPolicy((64,), 8, speculate=2)],
                         ids=["m1", "speculating"])
def test_a_server_of_256_slots_reads_them_all_in_one_packed_read(model, tok, policy):
    """Issue 59, item 1: packed reads serve as many rows as vLLM does by default (256; the buckets ended at 64 slots x
    64 tokens). 256 answers join at once: the LLM's first read takes the prompts of every row that routes, over 4,096
    tokens in one packed read, and the answers (a sample of them, alone, on each kind of prompt and threshold) are ``generate``'s alone."""
    tau = _threshold(model, tok, 0.6)
    run = _packed(Driver(model, tok, slots=256, policy=policy, capacity=96), policy.speculate)
    reads, widths = run.batch.layout.path.llm.steps, []
    read = reads.read
    reads.read = lambda tokens, plan: (widths.append((len(plan.rows), plan.real, plan.width)), read(tokens, plan))[1]

    def prompt(r: int) -> str:
        return " ".join(PROMPTS[(r + i) % 6] for i in range(3))

    def job(r: int) -> dict:
        return {"max_new_tokens": 3 + r % 4, "threshold": 0.0 if r % 3 else tau}

    run.batch.join([run.joiner(r, prompt(r), **job(r)) for r in range(256)])
    run.run()
    assert max(real for _, real, _ in widths) > 4096, widths[:3]
    for r in (0, 97, 128, 254, 255):
        assert run.out[r] == _alone(model, tok, prompt(r), **job(r)), r
    counters = run.batch.counters
    assert not policy.speculate or counters.agreed + counters.rejected > 0
