"""Draft blocks (core/fast/drafts.py, turn.decode_block): with speculation on and every proposing row greedy without
processors, the server drafts k steps on the device per host synchronisation. Every answer is ``generate``'s alone,
and the ledger moves exactly as it moves one step at a time."""

import pytest
import torch
from benchmarks.serving.cost_model import Costs
from benchmarks.serving.replay import Routed, replay
from conftest import SMALL_ROUTER

from r2r_hf import R2RForCausalLM

from r2r_hf.core.fast.slot_reads import capture_slots
from r2r_hf.core.policy import WaitPolicy
from r2r_hf.testing import make_tiny_slm
from r2r_hf.testing.graphs import EmulatedGraphStep
from test_batching import PROMPTS, Driver, _alone, _threshold


def _drafting(model, tok, policy: WaitPolicy, fuse: str | bool = "plain", slots: int = 4, prefill: int | None = 4):
    run = Driver(model, tok, slots=slots, policy=policy, capacity=96, prefill=prefill)
    pool = EmulatedGraphStep.new_pool(torch.device("cpu"))
    report = capture_slots(run.batch.layout, lambda fn, example: EmulatedGraphStep(fn, example, pool), warm=False,
                           fuse=fuse, speculate=policy.speculate, block=policy.block, gains=policy.draft_cost > 0)
    assert report["block"] == policy.block
    return run


@pytest.mark.parametrize("fuse", ["plain", False], ids=["fused", "hf-forward"])
@pytest.mark.parametrize("block,speculate", [(2, 4), (4, 4), (8, 4), (4, 0)],
                         ids=["2-speculating", "4-speculating", "8-speculating", "4-waiting"])
def test_drafted_answers_are_generates_alone(model, tok, fuse, block, speculate):
    tau = _threshold(model, tok, 0.6)
    policy = WaitPolicy((3,), 16, speculate=speculate, block=block)
    run = _drafting(model, tok, policy, fuse)
    syncs_before = run.batch.counters.host_syncs
    jobs = {i: {"max_new_tokens": 9 + 2 * i, "threshold": tau, "do_sample": False} for i in range(6)}
    for i in range(3):
        run.join(i, i, **jobs[i])
    run.run(steps=3)
    for i in range(3, 6):  # joining while the others draft, into slots the first ones leave
        for _ in range(200):
            if run.batch.ledger.free_slots():
                break
            run.run(steps=1)
        run.join(i, i, **jobs[i])
    run.run(steps=400)
    assert not run.batch.ledger.occupied(), "every answer ended (a token committed in a block reaches the host)"
    for i in range(6):
        assert run.out[i] == _alone(model, tok, i, **jobs[i]), i
    counters = run.batch.counters
    assert counters.llm_tokens > 0 and (not speculate or counters.agreed + counters.rejected > 0), "it routed"
    assert counters.host_syncs - syncs_before < counters.steps, "fewer synchronisations than steps: it drafted"


def test_a_block_answers_as_steps_one_at_a_time(model, tok):
    """The LLM runs at block boundaries (its policy's trigger may fall inside a block), so the steps and resolutions
    may differ; the answers may not."""
    tau = _threshold(model, tok, 0.6)
    runs = {}
    for block in (1, 4):
        run = _drafting(model, tok, WaitPolicy((4,), 32, speculate=3, block=block), slots=3, prefill=None)
        for i in range(3):
            run.join(i, i, max_new_tokens=14, threshold=tau, do_sample=False)
        run.run(steps=300)
        assert not run.batch.ledger.occupied()
        runs[block] = run
    one, four = runs[1].batch.counters, runs[4].batch.counters
    assert runs[1].out == runs[4].out
    assert four.host_syncs / four.steps < one.host_syncs / one.steps, "fewer synchronisations per step"


@pytest.fixture(scope="module")
def identity():
    """A pair whose LLM is its SLM: every pending position is confirmed, so tails fill and take frontier tokens."""
    slm = make_tiny_slm()
    return R2RForCausalLM.from_models(slm, slm, **SMALL_ROUTER)


@pytest.mark.parametrize("end", [3, 6, 9])
def test_blocks_at_threshold_0_take_frontier_tokens_own_depths_and_stop_at_an_end_in_the_tail(identity, tok, end):
    """Rows that route everywhere draft in blocks too: a row that fills its depth commits its last pending token
    unread and waits for its frontier token; a row's own depth and the depth by load (the load at the block's start)
    bound its tail; a tail that holds its answer's end goes no further. The device drafts as the host plans (else
    ``turn.decode_block`` raises), and every answer is ``generate``'s alone."""
    tau = _threshold(identity, tok, 0.6)
    eos = _alone(identity, tok, 1, max_new_tokens=20, do_sample=False, threshold=0.0)[end][0]
    jobs = {"greedy": (0, 16, {}), "ends": (1, 20, {"eos_token_id": eos}), "own depth": (2, 14, {}),
            "routed": (3, 12, {"threshold": tau})}
    policy = WaitPolicy((3,), 16, speculate=8, block=4, depths=(8, 6, 5))
    run = _drafting(identity, tok, policy, slots=4, prefill=None)
    for i, (name, (prompt, new, options)) in enumerate(jobs.items()):
        run.join(name, prompt, **{"max_new_tokens": new, "do_sample": False, "threshold": 0.0, **options})
    run.batch.ledger.rows[2].depth = 1
    syncs_before = run.batch.counters.host_syncs
    run.run(steps=400)
    assert not run.batch.ledger.occupied()
    for name, (prompt, new, options) in jobs.items():
        want = _alone(identity, tok, prompt, **{"max_new_tokens": new, "do_sample": False, "threshold": 0.0, **options})
        assert run.out[name] == want, name
    assert run.out["ends"][-1][0] == eos and len(run.out["ends"]) < 20, "the answer ended at its end token"
    counters = run.batch.counters
    assert counters.frontier_tokens > 0 and counters.agreed > 0
    assert counters.host_syncs - syncs_before < counters.steps, "fewer synchronisations than steps: it drafted"


def test_a_sampled_row_is_not_drafted(model, tok):
    """A sampled row's proposal is a draw on the host's stream: those steps run one at a time (and stay exact)."""
    tau = _threshold(model, tok, 0.6)
    run = _drafting(model, tok, WaitPolicy((3,), 16, speculate=4, block=4))
    options = {"max_new_tokens": 10, "threshold": tau, "do_sample": True, "temperature": 1.0, "seed": 7}
    run.join(0, 1, **options)
    run.run(steps=100)
    assert run.out[0] == _alone(model, tok, 1, **options)
    assert run.batch.counters.host_syncs >= run.batch.counters.steps


def test_the_replay_drafts_blocks_at_threshold_0_as_the_batch_does(identity, tok):
    """The cost model's replay (``benchmarks/serving/replay.drafted_block``) applies the device's rule: the same steps,
    resolutions, confirmed positions and frontier tokens as the running batch drafting blocks on the same load."""
    policy = WaitPolicy((3,), 16, speculate=8, block=4, depths=(8, 6, 3))  # (3 < the block: frontiers inside blocks)
    run = _drafting(identity, tok, policy, slots=4, prefill=256)  # (the replay reads prompts in pieces of 256)
    lengths = {i: 10 + 3 * i for i in range(4)}
    for i, new in lengths.items():
        run.join(i, i, max_new_tokens=new, do_sample=False, threshold=0.0)
    run.run(steps=400)
    real = run.batch.counters
    assert real.frontier_tokens > 0 and real.host_syncs < real.steps, "the setup: blocks with frontier tokens"
    answers = [(len(tok(PROMPTS[i])["input_ids"]), Routed([True] * new, [True] * new)) for i, new in lengths.items()]
    costs = Costs(slm=(0.01, 0.0, 0.0), llm=(0.1, 0.0, 0.0), router=(0.001, 0.0), step=0.0)
    got = replay(answers, 4, policy, costs, slots=4, routes=True)[0].counters
    fields = ("steps", "resolutions", "agreed", "frontier_tokens", "generated", "llm_tokens", "slm_forwards")
    assert {f: getattr(got, f) for f in fields} == {f: getattr(real, f) for f in fields}


def test_the_replay_ends_drafts_by_the_recorded_probabilities_as_blocks_and_steps_do():
    """The replay reads each answer's recorded SLM probabilities (``Routed.chances``) for the expected-gain rule, in
    its steps and its draft blocks alike: where the SLM is sure a draft runs to the row's depth, where it doubts
    (0.3 against a cost of 2.5: ``0.3 * (1 + 2.5) < 1 + 0.3``) every draft ends with its first token; without
    recorded probabilities the SLM counts as sure."""
    costs = Costs(slm=(0.01, 0.0, 0.0), llm=(0.1, 0.0, 0.0), router=(0.001, 0.0), step=0.0)
    fields = ("steps", "resolutions", "agreed", "frontier_tokens", "generated", "llm_forwards")
    got = {}
    for chances in ([1.0] * 40, [0.3] * 40, None):
        for block in (1, 4):
            policy = WaitPolicy((1,), 16, speculate=8, block=block, draft_cost=2.5)
            answers = [(20, Routed([True] * 40, [True] * 40, chances)) for _ in range(2)]
            c = replay(answers, 2, policy, costs, slots=2, routes=True)[0].counters
            got[None if chances is None else chances[0], block] = {f: getattr(c, f) for f in fields}, c.accepted.max
    for chance in (1.0, 0.3, None):
        assert got[chance, 4] == got[chance, 1], f"blocks and steps end the same drafts (chance {chance})"
    assert got[1.0, 1][1] == 8 and got[0.3, 1][1] == 1, "sure: as deep as the row may; doubting: one token"
    assert got[None, 1] == got[1.0, 1], "no recorded probabilities: sure"


def _median_chance(model, tok) -> float:
    """The median of the SLM's probability of its argmax over the three prompts' tokens (about half are under it)."""
    enc = tok([PROMPTS[i] for i in range(3)], return_tensors="pt", padding=True)
    with torch.no_grad():
        chances = model.slm(**enc).logits.float().softmax(-1).amax(-1)[enc["attention_mask"].bool()]
    return float(chances.median())


def _three_lossless_rows(model, tok, policy: WaitPolicy, new: int):
    """Three rows at threshold 0 drafted under ``policy``, each answer held to generate's alone; the counters."""
    run = _drafting(model, tok, policy, slots=3, prefill=None)
    for i in range(3):
        run.join(i, i, max_new_tokens=new, do_sample=False, threshold=0.0)
    run.run(steps=400)
    for i in range(3):
        assert run.out[i] == _alone(model, tok, i, max_new_tokens=new, do_sample=False, threshold=0.0), (policy, i)
    return run.batch.counters


def test_blocks_end_drafts_where_the_slm_is_unsure(identity, tok):
    """``draft_confidence`` on the device: where the SLM's probability of its token is under it, a row at threshold 0
    ends its draft inside the block with that token, as it would step by step (fewer pending positions than without
    it; at 1 every draft holds one); answers unchanged."""
    median = _median_chance(identity, tok)  # about half the positions unsure
    pending, blocks, longest = {}, {}, {}
    for floor in (0.0, median, 1.0):
        c = _three_lossless_rows(identity, tok, WaitPolicy((3,), 16, speculate=8, block=4, draft_confidence=floor), 14)
        pending[floor], blocks[floor], longest[floor] = c.agreed + c.rejected, c.steps - c.host_syncs, c.accepted.max
    assert blocks[0.0] > 0 and blocks[median] > 0, "it drafted in blocks"
    assert 0 < pending[median] < pending[0.0] and longest[1.0] == 1 < longest[0.0], "the identity pair confirms all"


def test_blocks_end_drafts_by_the_expected_gain_rule_as_steps_do(identity, tok):
    """``draft_cost`` on the device: a draft block carries each row's tail probabilities (``Standing.chance``,
    ``expected``) from step to step and ends its draft where the host's rule would: drafting in blocks of 4 or step
    by step, the rows resolve, confirm and take frontier tokens alike, fewer than without the rule; answers
    unchanged. (A first token ends its draft where the SLM's probability p of it has p * cost < 1: a cost of 1 / the
    median probability ends about half of them there.)"""
    cost = 1 / _median_chance(identity, tok)
    counted = {}
    for block, rule in ((1, 0.0), (1, cost), (4, cost)):
        c = _three_lossless_rows(identity, tok, WaitPolicy((3,), 16, speculate=8, block=block, draft_cost=rule), 20)
        counted[block, bool(rule)] = {f: getattr(c, f) for f in ("resolutions", "agreed", "rejected",
                                                                  "frontier_tokens", "llm_forwards")}
        assert block == 1 or c.host_syncs < c.steps, "it drafted in blocks"
    assert counted[4, True] == counted[1, True], "blocks and steps end the same drafts"
    assert counted[1, True]["agreed"] < counted[1, False]["agreed"], "the rule ended drafts early"


def test_blocks_captured_without_the_expected_gain_rule_refuse_rows_that_ask_for_it(identity, tok):
    """A block captured without the rule would draft past where its rows' drafts end (it reads no probabilities):
    it says so rather than draft otherwise than the steps would."""
    policy = WaitPolicy((3,), 16, speculate=8, block=4, draft_cost=2.5)
    run = Driver(identity, tok, slots=2, policy=policy, capacity=96, prefill=None)
    pool = EmulatedGraphStep.new_pool(torch.device("cpu"))
    capture_slots(run.batch.layout, lambda fn, example: EmulatedGraphStep(fn, example, pool), warm=False,
                  fuse="plain", speculate=8, block=4)  # (gains left out)
    run.join(0, 0, max_new_tokens=12, do_sample=False, threshold=0.0)
    with pytest.raises(RuntimeError, match="captured without the expected-gain rule"):
        run.run(steps=50)


@pytest.mark.parametrize("depth", [1, 2, 3])
def test_a_row_that_ends_inside_a_block_leaves_its_neighbours_tokens_to_arrive(identity, tok, depth):
    """A row that never routes ends at its end token inside a block (the device drafts on for it), while a row at
    threshold 0 fills its depth there and waits for its frontier token: the token that row committed last reaches
    the host at the next step (not what the device drafted after it for the row that left); both answers as alone."""
    free = _alone(identity, tok, 2, max_new_tokens=16, do_sample=False, threshold=float("inf"))
    for end in range(1, 9):
        eos = free[end][0]
        if eos in [t for t, _ in free[:end]]:
            continue  # (the answer would end at its first occurrence)
        jobs = {"ends": (2, {"threshold": float("inf"), "eos_token_id": eos}), "lossless": (0, {"threshold": 0.0})}
        run = _drafting(identity, tok, WaitPolicy((2,), 16, speculate=depth, block=4), slots=2, prefill=None)
        for name, (prompt, options) in jobs.items():
            run.join(name, prompt, max_new_tokens=12, do_sample=False, **options)
        run.run(steps=200)
        for name, (prompt, options) in jobs.items():
            assert run.out[name] == _alone(identity, tok, prompt, max_new_tokens=12, do_sample=False, **options), \
                (name, end)


@pytest.mark.parametrize("adapts", [False, True], ids=["fixed", "adapting"])
def test_blocks_draft_each_row_to_its_own_depth(identity, tok, adapts):
    """A row's depth by acceptance (``plan.adapted``, moved when the LLM judges its tail, never inside a block) is the
    depth the host plans each block with and the device drafts to: with the identity pair every tail is confirmed
    whole, so two rows at threshold 0 draft 4 then 8 (the depth) where fixed depths draft 8 at once; answers as
    alone either way."""
    from r2r_hf.core.counters import ACCEPTED_BOUNDS

    run = _drafting(identity, tok, WaitPolicy((2,), 16, speculate=8, block=4, adapts=adapts), slots=2, prefill=None)
    for i in range(2):
        run.join(i, i, max_new_tokens=30, do_sample=False, threshold=0.0)
    syncs_before = run.batch.counters.host_syncs
    run.run(steps=400)
    for i in range(2):
        assert run.out[i] == _alone(identity, tok, i, max_new_tokens=30, do_sample=False, threshold=0.0), i
    c = run.batch.counters
    assert c.host_syncs - syncs_before < c.steps, "it drafted in blocks"
    by_depth = dict(zip((*ACCEPTED_BOUNDS, "more"), c.drafted.counts))
    # 30 tokens a row: drafts of 8, 8, 8 (each with its frontier token) and 3 fixed; 4, 8, 8 and 7 adapting
    assert (by_depth[3], by_depth[4], by_depth[8]) == ((0, 2, 6) if adapts else (2, 0, 6)) and c.drafted.max == 8
