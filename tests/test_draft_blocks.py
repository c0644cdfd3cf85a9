"""Draft blocks (core/fast/drafts.py, turn.decode_block): with speculation on and every proposing row greedy without
processors, the server drafts k steps on the device per host synchronisation. Every answer is ``generate``'s alone,
and the ledger moves exactly as it moves one step at a time."""

import pytest
import torch

from r2r_hf.core.fast.slot_reads import capture_slots
from r2r_hf.core.policy import WaitPolicy
from r2r_hf.testing.graphs import EmulatedGraphStep
from test_batching import Driver, _alone, _threshold


def _drafting(model, tok, policy: WaitPolicy, fuse: str | bool = "plain", slots: int = 4, prefill: int | None = 4):
    run = Driver(model, tok, slots=slots, policy=policy, capacity=96, prefill=prefill)
    pool = EmulatedGraphStep.new_pool(torch.device("cpu"))
    report = capture_slots(run.batch.layout, lambda fn, example: EmulatedGraphStep(fn, example, pool), warm=False,
                           fuse=fuse, speculate=policy.speculate, block=policy.block)
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


def test_a_sampled_row_is_not_drafted(model, tok):
    """A sampled row's proposal is a draw on the host's stream: those steps run one at a time (and stay exact)."""
    tau = _threshold(model, tok, 0.6)
    run = _drafting(model, tok, WaitPolicy((3,), 16, speculate=4, block=4))
    options = {"max_new_tokens": 10, "threshold": tau, "do_sample": True, "temperature": 1.0, "seed": 7}
    run.join(0, 1, **options)
    run.run(steps=100)
    assert run.out[0] == _alone(model, tok, 1, **options)
    assert run.batch.counters.host_syncs >= run.batch.counters.steps
