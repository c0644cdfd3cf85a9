"""The running batch (core/batch.py) and its turns (core/turn.py): every row answers what it answers alone.

The loop here is the server's, driven by hand so the test decides when rows join: rows with their own
thresholds, budgets, seeded sampling and a repetition penalty (a processor that reads the row's tokens) join a
batch mid-way, end at different lengths and leave, under every waiting policy; each row's tokens, and which of
them the LLM wrote, must equal ``generate`` alone.
"""

import pytest
import torch

from r2r_hf.core.batch import Joiner, RunningBatch
from r2r_hf.core.policy import WaitPolicy
from r2r_hf.core.turn import turn
from r2r_hf.model.row_settings import resolve_row

PROMPTS = ["water", "the old man said that he was a good", "write a new line", "he",
           "the first time you see the old man say that", "def print(x): return"]


def _threshold(model, tok, quantile: float) -> float:
    """A threshold near the ``quantile`` of the router's scores, in the widest gap there (no float near-ties)."""
    enc = tok(PROMPTS, return_tensors="pt", padding=True)
    probe = model.generate(**enc, max_new_tokens=10, do_sample=False, threshold=float("inf"), return_dict_in_generate=True)
    scores = probe.router_scores[probe.generated_mask].sort().values
    gaps = scores[1:] - scores[:-1]
    lo, hi = int(len(gaps) * (quantile - 0.1)), int(len(gaps) * (quantile + 0.1))
    i = lo + int(gaps[lo:hi].argmax())
    return float((scores[i] + scores[i + 1]) / 2)


class Driver:
    """The server's loop by hand: ``join`` rows, ``run`` steps; each row's (token, by LLM) pairs as they arrive."""

    def __init__(self, model, tok, slots: int, policy: WaitPolicy, capacity: int = 64, prefill: int | None = None):
        self.model, self.tok, self.policy, self.prefill = model, tok, policy, prefill
        self.batch = RunningBatch.for_slots(model.routed_pair().for_call(), slots, capacity, torch.device("cpu"))
        self.out, self.limit, self.eos = {}, {}, {}

    def join(self, name, prompt, **options):
        self.batch.join([self.joiner(name, prompt, **options)], prefill=self.prefill)  # (as the server's engine joins)

    def joiner(self, name, prompt, **options) -> Joiner:
        """Row ``name`` of ``prompt`` (an index of ``PROMPTS`` or a text), resolved as the server resolves it."""
        ids = self.tok(PROMPTS[prompt] if isinstance(prompt, int) else prompt)["input_ids"]
        settings = resolve_row(self.model, ids, **options)
        self.out[name], self.limit[name], self.eos[name] = [], settings.max_new_tokens, settings.eos_ids
        rule = settings.rule(torch.device("cpu"), fresh_seed=0)
        return Joiner(ids, settings.max_new_tokens, settings.threshold, rule, settings.llm_budget, name,
                      ends=settings.eos_ids)

    def reads(self):  # the stop rule of the turns (core.turn.Stops): EOS or the length limit
        return ()

    def ended(self, synced):
        ended = {}
        for r in self.batch.ledger.occupied():
            name = self.batch.ledger.rows[r].owner
            for taken, (token, by_llm, _) in enumerate(synced.delivered[r], 1):
                self.out[name].append((token, by_llm))
                if token in self.eos[name] or len(self.out[name]) == self.limit[name]:
                    ended[r] = taken
                    break
        return ended

    def run(self, steps: int | None = None):
        """``steps`` turns, or until every row ended."""
        done = 0
        while self.batch.ledger.occupied() and (steps is None or done < steps):
            turn(self.batch, self.policy, self, self.prefill)
            done += 1


def _alone(model, tok, prompt, **options):
    enc = tok([PROMPTS[prompt] if isinstance(prompt, int) else prompt], return_tensors="pt")
    seed = options.pop("seed", None)
    out = model.generate(**enc, **options, **({} if seed is None else {"seed": seed}), return_dict_in_generate=True)
    tokens = out.sequences[0, enc["input_ids"].shape[1]:].tolist()
    routed = out.routed[0].tolist()
    got = []
    for token, by_llm, real in zip(tokens, routed, out.generated_mask[0].tolist()):
        if real:
            got.append((token, by_llm))
    return got


POLICIES = [WaitPolicy((m,), w) for m in (1, 2, 4) for w in (1, 4, 64)]


@pytest.mark.parametrize("policy", POLICIES, ids=lambda p: f"m{p.min_rows[0]}-w{p.max_wait}")
def test_rows_joining_waiting_and_leaving_answer_as_generate_alone(model, tok, policy):
    tau = _threshold(model, tok, 0.3)  # routes a good share of the tokens
    rows = {
        "greedy": (0, dict(max_new_tokens=9, do_sample=False, threshold=tau)),
        "long": (1, dict(max_new_tokens=14, do_sample=False, threshold=tau)),
        "sampled": (2, dict(max_new_tokens=11, do_sample=True, temperature=0.9, top_k=20, seed=7, threshold=tau)),
        "budget": (4, dict(max_new_tokens=12, do_sample=False, threshold=0.0, llm_budget=0.3)),
        "penalty": (5, dict(max_new_tokens=10, do_sample=False, threshold=tau, repetition_penalty=1.4)),
        "sampled2": (3, dict(max_new_tokens=8, do_sample=True, temperature=1.1, seed=3, threshold=tau / 2)),
    }
    run = Driver(model, tok, slots=5, policy=policy)
    order = list(rows)
    for name in order[:3]:
        run.join(name, rows[name][0], **rows[name][1])
    run.run(3)
    for name in order[3:5]:  # join while the first rows decode (and some wait for the LLM)
        run.join(name, rows[name][0], **rows[name][1])
    run.run(6)
    while run.batch.ledger.free_slots() == 0:
        run.run(1)
    run.join(order[5], rows[order[5]][0], **rows[order[5]][1])  # into a slot a finished row left
    run.run()
    routed = 0
    for name, (prompt, options) in rows.items():
        want = _alone(model, tok, prompt, **dict(options))
        assert run.out[name] == want, name
        routed += sum(r for _, r in want)
    assert routed >= 6, "the LLM wrote a good share of the tokens"
    counters = run.batch.counters
    assert counters.llm_tokens == routed and counters.generated == sum(len(v) for v in run.out.values())
    assert counters.host_syncs == counters.steps, "one host synchronisation per step"
    if policy.immediate:
        assert counters.waits.max == 0 and len(counters.waits) == counters.llm_tokens
    else:
        assert 0 < counters.waits.max <= policy.max_wait and len(counters.waits) == counters.llm_tokens
        assert counters.llm_rows > counters.llm_calls, "some LLM forwards wrote several rows' tokens"


def test_waiting_cuts_llm_forwards_and_joins_copy_nothing(model, tok):
    tau = _threshold(model, tok, 0.85)  # about one token in seven routes: the regime waiting is for
    counts = {}
    for policy in (WaitPolicy((1,), 0), WaitPolicy((3,), 16)):
        run = Driver(model, tok, slots=6, policy=policy, capacity=128)
        for i in range(6):
            run.join(i, i, max_new_tokens=16, do_sample=False, threshold=tau)
        run.run()
        counts[policy.immediate] = run.batch.counters
    immediate, waiting = counts[True], counts[False]
    assert immediate.llm_tokens == waiting.llm_tokens > 0, "the same tokens routed"
    assert waiting.llm_calls < immediate.llm_calls  # (tiny models route in step across rows: a modest cut)
    assert waiting.llm_rows / waiting.llm_calls > immediate.llm_rows / immediate.llm_calls
    assert waiting.join_bytes == immediate.join_bytes == 0, "the slots had room: a join copies no cache"


def test_a_join_that_needs_more_columns_grows_every_slot_and_counts_the_copy(model, tok):
    run = Driver(model, tok, slots=2, policy=WaitPolicy(), capacity=8)
    run.join("a", 0, max_new_tokens=3, do_sample=False, threshold=0.0)
    run.run(2)
    assert run.batch.counters.join_bytes == 0
    run.join("b", 1, max_new_tokens=12, do_sample=False, threshold=0.0)  # its prompt + answer need > 8 columns
    assert run.batch.counters.join_bytes > 0
    run.run()
    assert run.out["a"] == _alone(model, tok, 0, max_new_tokens=3, do_sample=False, threshold=0.0)
    assert run.out["b"] == _alone(model, tok, 1, max_new_tokens=12, do_sample=False, threshold=0.0)


def test_a_long_prompt_is_read_a_chunk_per_step_while_the_others_decode(model, tok):
    """Chunked prefill: a joining prompt of 60+ tokens is read 8 tokens per turn by each model, and every turn
    the running rows still take their step; every answer equals generate alone."""
    long_prompt = " ".join(PROMPTS) + " " + " ".join(PROMPTS[::-1])
    assert len(tok(long_prompt)["input_ids"]) > 60
    run = Driver(model, tok, slots=3, policy=WaitPolicy(), capacity=160, prefill=8)
    run.batch.counters.shapes = []
    run.join("a", 0, max_new_tokens=20, do_sample=False, threshold=0.0)
    run.run(2)
    run.join("long", long_prompt, max_new_tokens=6, do_sample=False, threshold=0.0)
    steps, decoded = run.batch.counters.steps, len(run.out["a"])
    run.run(4)
    assert run.batch.counters.steps == steps + 4 and len(run.out["a"]) == decoded + 4, "the others kept decoding"
    assert run.batch.ledger.rows[1].prefilling, "the long prompt is still being read"
    run.run()
    assert max(g for role, k, g in run.batch.counters.shapes) <= 8, "no forward read more than a chunk"
    assert run.out["a"] == _alone(model, tok, 0, max_new_tokens=20, do_sample=False, threshold=0.0)
    assert run.out["long"] == _alone(model, tok, long_prompt, max_new_tokens=6, do_sample=False, threshold=0.0)
