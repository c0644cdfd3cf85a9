"""The CPU emulation of CUDA graphs fails where a real capture or replay would go wrong.

Each check is shown failing on a deliberately broken step: host synchronisations (the ten probes
a review tried), a Python decision that a replay would not re-take, and a caller that keeps a
replay's output while another graph of the same pool replays.
"""

import pytest
import torch

from r2r_hf.core.fast.graphs import CudaGraphStep
from r2r_hf.testing.graphs import EmulatedGraphStep, EmulatedPool, HostSyncError, ReplayMismatch, emulated_store

CUDA = torch.cuda.is_available()
pytestmark = pytest.mark.skipif(CUDA, reason="checks the CPU emulation; on CUDA the graphs are real")

def _assigned(x):
    y = x.clone()
    # A tensor value: torch >= 2.15 turns a boolean-mask assignment of a Python scalar into masked_fill_, which
    # needs no host sync (and is capturable); with a tensor it stays index_put_, which does.
    y[x > 0] = x.new_ones(())
    return y


PROBES = {
    "item": lambda x: (x * x.sum().item(),),
    "bool": lambda x: (x * (1 if bool(x.sum() > 0) else 2),),
    "nonzero": lambda x: (x.nonzero().float().sum() + x,),
    "boolean mask index": lambda x: (x[x > 0].sum() + x,),
    "boolean mask assignment": lambda x: (_assigned(x),),
    "to cpu": lambda x: (x.to("cpu") + 1,),
    "cpu": lambda x: (x.cpu() + 1,),
    "tolist": lambda x: (x + len(x.tolist()),),
    "torch.tensor from host data": lambda x: (x + torch.tensor([1.0, 2.0, 3.0, 4.0]),),
    "repeat_interleave": lambda x: (torch.repeat_interleave(x, (x > 0).long()).sum() + x,),
    "bincount": lambda x: (torch.bincount((x > 0).long()).sum() + x,),
    "randperm": lambda x: (x[torch.randperm(4)],),
    "rand": lambda x: (x + torch.rand(4),),
    "multinomial": lambda x: (x + torch.multinomial(x.softmax(-1), 1).float(),),
}


def _step(fn, x=None):
    example = {"x": torch.tensor([0.5, -1.0, 2.0, 3.0]) if x is None else x}
    return EmulatedGraphStep(lambda x: fn(x), example, EmulatedPool())


@pytest.mark.parametrize("name", list(PROBES))
def test_every_host_synchronisation_fails_the_capture(name):
    with pytest.raises(HostSyncError):
        _step(PROBES[name])


def test_a_clean_step_captures_and_replays_like_eager():
    step = _step(lambda x: (x.softmax(-1) * 2, x.argmax(-1)))
    x = torch.tensor([1.0, 4.0, 2.0, 0.0])
    got = step(x=x)
    assert torch.equal(got[0], x.softmax(-1) * 2) and got[1].item() == 1


def test_a_python_decision_that_changes_between_replays_is_caught():
    calls = {"n": 0}

    def counted(x):  # a length kept on the host: a real graph replays the captured slice forever
        calls["n"] += 1
        return (x[: 1 + calls["n"] % 3] * 2,)

    step = _step(counted)
    with pytest.raises(ReplayMismatch, match="another path"):
        step(x=torch.ones(4))


def test_a_replay_overwrites_what_an_earlier_replay_returned_without_the_copy():
    uncopied = type("Uncopied", (EmulatedGraphStep,), {"__call__": lambda self, **inputs: (
        [self.inputs[k].copy_(v) for k, v in inputs.items()], self.replay(), self.outputs)[-1]})
    step = uncopied(lambda x: (x * 2,), {"x": torch.ones(4)}, EmulatedPool())
    first = step(x=torch.ones(4))[0]
    step(x=torch.full((4,), 3.0))
    assert torch.equal(first, torch.full((4,), 6.0)), "the first replay's output was overwritten"


def test_graphs_of_one_pool_poison_each_others_outputs_and_copies_survive():
    pool = EmulatedPool()
    a = EmulatedGraphStep(lambda x: (x * 2,), {"x": torch.ones(4)}, pool)
    b = EmulatedGraphStep(lambda x: (x + 1,), {"x": torch.ones(4)}, pool)
    kept = a(x=torch.ones(4))[0]  # a copy, as CudaGraphStep returns
    inner = a.outputs[0]  # what a caller without the copy would hold
    b(x=torch.ones(4))
    assert torch.equal(kept, torch.full((4,), 2.0)), "the copy is the caller's own"
    assert torch.isnan(inner).all(), "b's replay overwrote a's outputs, as in a shared CUDA pool"


def test_the_emulation_is_the_real_step_with_only_the_cuda_primitives_replaced():
    assert issubclass(EmulatedGraphStep, CudaGraphStep)
    assert EmulatedGraphStep.__call__ is CudaGraphStep.__call__, "copy-in and copy-out are the real ones"


def test_the_collector_is_off_from_the_warm_up_to_the_end_of_the_capture(monkeypatch):
    # Since torch 2.9 torch.cuda.graph no longer collects on entry: a dead graph freed by a collection during another
    # capture would invalidate it. CudaGraphStep turns the collector off around its warm-up and capture (the
    # emulation too); a caller capturing many collects once first, at the outermost entry.
    import gc

    from r2r_hf.core.fast.graphs import gc_paused

    seen = []
    _step(lambda x: (seen.append(gc.isenabled()) or x * 2,))
    assert seen == [False, False] and gc.isenabled(), "off during the warm-up and the capture, on again after"
    collected = []
    monkeypatch.setattr(gc, "collect", lambda *args: collected.append(1) or 0)
    with gc_paused(collect=True):
        with gc_paused(collect=True):
            _step(lambda x: (x * 2,))
        assert not gc.isenabled(), "a capture inside does not turn it back on"
    assert collected == [1] and gc.isenabled(), "collected once, at the outermost entry"
    gc.disable()
    try:
        with gc_paused():
            pass
        assert not gc.isenabled(), "a collector the caller had turned off stays off"
    finally:
        gc.enable()


@pytest.mark.parametrize("sampling", [True, False], ids=["router step", "folded into the SLM read"])
def test_a_host_sync_inside_the_loops_router_step_fails_generate(model, tok, monkeypatch, sampling):
    from r2r_hf.core.fast import static_reads as capture

    real_step, real_fold = capture.router_fn, capture.folded

    def syncing_router(slm, router, k):
        route = real_step(slm, router, k)
        return lambda logits, hidden, token: (route(logits, hidden, token)[0] * (logits.sum() > 0).item(),)

    def syncing_fold(read, slm, router, k, vocab):
        step = real_fold(read, slm, router, k, vocab)
        return lambda **inputs: (*step(**inputs)[:2], step(**inputs)[2] * (inputs["ids"].sum() > 0).item())

    monkeypatch.setattr(model, "capture_store", emulated_store())
    monkeypatch.setattr(capture, "router_fn", syncing_router)
    monkeypatch.setattr(capture, "folded", syncing_fold)
    enc = tok(["the old man said that he was", "water"], return_tensors="pt", padding=True)
    with pytest.raises(HostSyncError):  # greedy: the router runs inside the SLM's read; sampling: its own step
        model.generate(**enc, max_new_tokens=4, do_sample=sampling, pad_token_id=0, threshold=0.5,
                       cache_implementation="static")
