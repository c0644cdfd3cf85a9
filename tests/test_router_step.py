"""The router on the captured path (issue 32): folded into the SLM's read, and in the models' dtype.

On emulated CUDA graphs: where a call proposes the raw argmax (greedy, no processors) the SLM's read scores the
proposal itself and no router step is captured, and generate writes and scores what eager generate does; where
it samples or processes, the router keeps its own step. In bf16 the captured steps score with a bf16 copy that
stays within the tolerance of the fp32 router and follows the router's weights when they change; a copy off by
more than the tolerance is dropped, said once; fp32 stays exact.
"""

import logging

import pytest
import torch
from conftest import PROMPTS, SMALL_ROUTER

from r2r_hf import R2RForCausalLM
from r2r_hf.core.fast import router_copy as router_step
from r2r_hf.core.fast.router_copy import SCORE_TOLERANCE, proposal_is_argmax, router_copy
from r2r_hf.testing import make_tiny_llm, make_tiny_slm
from r2r_hf.testing.graphs import emulated_store

INF = float("inf")
GREEDY = dict(max_new_tokens=10, do_sample=False, pad_token_id=0, eos_token_id=2,
              return_dict_in_generate=True, output_logits=True)

# Captured and eager scores of the same weights may sum in another order (float32): 1.01e-6 apart was seen under
# the oldest supported transformers. A replay of freed weights is off by far more (the scores are random there).
SCORES = dict(rtol=0, atol=1e-5)


def _pair(dtype=torch.float32, router_dtype="model"):
    slm, llm = make_tiny_slm().to(dtype), make_tiny_llm().to(dtype)
    model = R2RForCausalLM.from_models(slm, llm, **SMALL_ROUTER)
    model.capture_store = emulated_store(fuse=False)
    model.capture_store.router_dtype = router_dtype
    return model, slm, llm


def _mixed(model, enc):
    probe = model.generate(**enc, **GREEDY, threshold=INF)
    scores = probe.router_scores[probe.generated_mask].sort().values
    middle = len(scores) // 2
    return ((scores[middle - 1] + scores[middle]) / 2).item()  # between two scores, not on one


def _run(model, enc, threshold, **extra):
    settings = {**GREEDY, **extra, "threshold": threshold}
    torch.manual_seed(3)
    eager = model.generate(**enc, **settings)
    torch.manual_seed(3)
    fast = model.generate(**enc, **settings, cache_implementation="static")
    return eager, fast


@pytest.mark.parametrize("rows", [1, 2])
def test_a_greedy_call_scores_inside_the_slm_read_and_writes_what_eager_writes(tok, rows):
    model, slm, llm = _pair()
    enc = tok(PROMPTS[:rows], return_tensors="pt", padding=True)
    for threshold, alone in ((INF, slm), (0.0, llm), (_mixed(model, enc), None)):
        eager, fast = _run(model, enc, threshold)
        assert torch.equal(fast.sequences, eager.sequences) and torch.equal(fast.routed, eager.routed)
        torch.testing.assert_close(fast.router_scores, eager.router_scores, equal_nan=True, **SCORES)
        if alone is not None:
            want = alone.generate(**enc, max_new_tokens=10, do_sample=False, pad_token_id=0, eos_token_id=2)
            assert torch.equal(fast.sequences, want)
        else:
            assert 0 < fast.routed[fast.generated_mask].sum() < fast.generated_mask.sum(), "mixed: some routed"
    state = model.capture_store.state
    assert state.router_step is None, "no router step of its own: every score came from an SLM read"
    assert {key[3] for key in state.reads if key[0] == "slm"} == {True, False}, "threshold 0 reads without scoring"


@pytest.mark.parametrize("extra", [dict(do_sample=True, temperature=0.8), dict(repetition_penalty=1.3)],
                         ids=["sampling", "processor"])
def test_a_call_whose_proposal_is_not_the_argmax_keeps_the_router_step(tok, extra):
    model, _, _ = _pair()
    enc = tok(PROMPTS, return_tensors="pt", padding=True)
    eager, fast = _run(model, enc, _mixed(model, enc), **extra)
    assert torch.equal(fast.sequences, eager.sequences) and torch.equal(fast.routed, eager.routed)
    torch.testing.assert_close(fast.router_scores, eager.router_scores, equal_nan=True, **SCORES)
    state = model.capture_store.state
    assert state.router_step is not None
    assert {key[3] for key in state.reads if key[0] == "slm"} == {False}


def test_the_rule_for_folding():
    assert proposal_is_argmax(False, [])
    assert not proposal_is_argmax(True, [])
    assert not proposal_is_argmax(False, [lambda ids, scores: scores])
    assert not proposal_is_argmax(False, None)


def _fast_scores(model, enc, router_dtype, **extra):
    """Captured never-routed scores under ``router_dtype``: the same SLM graphs, so the same features."""
    model.capture_store.router_dtype = router_dtype
    torch.manual_seed(3)
    out = model.generate(**enc, **{**GREEDY, **extra}, threshold=INF, cache_implementation="static")
    return out.router_scores[out.generated_mask], model.capture_store.state


@pytest.mark.parametrize("extra", [{}, dict(do_sample=True, temperature=0.8)], ids=["folded", "router step"])
def test_bf16_models_score_with_a_bf16_router_within_the_tolerance(tok, extra):
    model, _, _ = _pair(torch.bfloat16)
    enc = tok(PROMPTS, return_tensors="pt", padding=True)
    cast, state = _fast_scores(model, enc, "model", **extra)
    assert state.scorer.cast is not None and state.scorer.module.combined_projection.weight.dtype == torch.bfloat16
    assert (state.router_step is None) == (not extra), "greedy folds; sampling scores in the router's own step"
    assert model.router.combined_projection.weight.dtype == torch.float32, "the router itself is untouched"
    full, state = _fast_scores(model, enc, "float32", **extra)
    assert state.scorer.cast is None and state.scorer.module is model.router
    gap = (cast - full).abs().max()
    assert 0 < gap <= SCORE_TOLERANCE, "a bf16 copy: close to the fp32 router's scores, not equal to them"


@pytest.mark.parametrize("through_data", [False, True], ids=["in place", "through .data"])
def test_the_bf16_copy_follows_the_routers_new_weights(tok, through_data):
    model, _, _ = _pair(torch.bfloat16)
    enc = tok(PROMPTS, return_tensors="pt", padding=True)
    before, state = _fast_scores(model, enc, "float32")
    _fast_scores(model, enc, "model")
    state = model.capture_store.state
    _, last = list(model.router.named_parameters())[-1]  # the output's bias: shifts every logit
    with torch.no_grad():
        (last.data if through_data else last).add_(2.0)  # as training, EMA or weight loading write it
    after, again = _fast_scores(model, enc, "model")
    assert again is state, "the same state and graphs: the new values were copied into the copy"
    full, _ = _fast_scores(model, enc, "float32")
    assert (full - before).abs().min() > SCORE_TOLERANCE, "the change moves every score past the tolerance"
    assert (after - full).abs().max() <= SCORE_TOLERANCE, "so a stale copy would fail here"


def test_a_copy_past_the_tolerance_is_dropped_and_said_once(tok, caplog, monkeypatch):
    model, _, _ = _pair(torch.bfloat16)
    enc = tok(PROMPTS, return_tensors="pt", padding=True)
    full, _ = _fast_scores(model, enc, "float32")
    monkeypatch.setattr(router_step, "SCORE_TOLERANCE", -1.0)  # every difference is too large
    with caplog.at_level(logging.WARNING, logger="r2r_hf.core.fast.router_copy"):
        dropped, state = _fast_scores(model, enc, "model")
        _fast_scores(model, enc, "model")
    assert state.scorer.cast is None and torch.equal(dropped, full)
    assert sum("scores with the router in float32" in r.getMessage() for r in caplog.records) == 1


def test_an_unknown_router_dtype_is_one_sentence():
    model, _, _ = _pair()
    with pytest.raises(ValueError, match="router_dtype must be one of float32, model, got 'half'"):
        router_copy(model.router, torch.bfloat16, "half")


def _server_router(model, router_dtype):
    from r2r_hf.core.fast.slot_reads import CapturedRouter

    capturer = emulated_store()._capturer(None, torch.device("cpu"))
    return CapturedRouter(model.slm, model.router, model.config.num_topk_logits, capturer, 4, router_dtype)


def _features(model, rows=3):
    ids = torch.randint(3, 400, (rows, 6))
    with torch.no_grad():
        out = model.slm(input_ids=ids, output_hidden_states=True)
    logits, hidden = out.logits[:, -1], out.hidden_states[-1][:, -1]
    return logits, hidden, logits.argmax(-1)


def test_the_servers_router_scores_in_bf16_within_the_tolerance_and_checks_real_proposals(monkeypatch):
    from r2r_hf.core.layouts.model_calls import route_scores

    model, _, _ = _pair(torch.bfloat16)
    features = _features(model)
    want = route_scores(model.slm, model.router, model.config.num_topk_logits, *features)
    served = _server_router(model, "model")
    assert served.warm(416, 64, torch.device("cpu"), torch.bfloat16) == 3 and not served.scorer.checked, \
        "warming scores zeros: it does not count as the check"
    got = served(*features)
    assert served.scorer.checked and served.scorer.cast is not None
    assert served.scorer.module.combined_projection.weight.dtype == torch.bfloat16
    assert 0 < (got - want).abs().max() <= SCORE_TOLERANCE
    monkeypatch.setattr(router_step, "SCORE_TOLERANCE", -1.0)
    dropped = _server_router(model, "model")
    dropped.warm(416, 64, torch.device("cpu"), torch.bfloat16)
    torch.testing.assert_close(dropped(*features), want, **SCORES)  # captured again over the router itself
    assert dropped.scorer.cast is None
    torch.testing.assert_close(_server_router(model, "float32")(*features), want, **SCORES)


def test_a_router_with_per_step_state_is_neither_copied_nor_scored_ahead_of_its_step(tok):
    from r2r_hf.router import Router

    class Stepped(Router):  # routes every other step: its state changes in step(), right before it scores
        def __init__(self, inner):
            super().__init__()
            self.inner = inner
            self.register_buffer("odd", torch.zeros(()))

        def reset(self):
            self.odd.zero_()

        def step(self):
            self.odd.fill_(1.0 - float(self.odd))

        def scores(self, topk_logits, token_embedding, hidden):
            return self.odd * self.inner.scores(topk_logits, token_embedding, hidden) + self.odd

    model, _, _ = _pair(torch.bfloat16)
    model.router = Stepped(model.router)
    enc = tok(PROMPTS, return_tensors="pt", padding=True)
    eager, fast = _run(model, enc, 1.0)
    assert eager.routed[:, ::2].all() and not eager.routed[:, 1::2].any()
    assert torch.equal(fast.routed, eager.routed), "the captured path scored after each step() too"
    state = model.capture_store.state
    assert state.scorer.cast is None and state.router_step is not None


@pytest.mark.parametrize("made_in_inference_mode", [True, False])
def test_a_copy_made_in_inference_mode_still_follows_updates_made_outside(made_in_inference_mode):
    from r2r_hf.core.fast.router_copy import RouterCopy

    layer = torch.nn.Linear(4, 4)
    with torch.inference_mode(made_in_inference_mode):  # the server captures under inference mode
        cast = RouterCopy(layer, torch.bfloat16)
    with torch.no_grad():
        layer.weight.add_(1.0)
    cast.refresh()
    assert cast.module.weight.dtype == torch.bfloat16
    torch.testing.assert_close(cast.module.weight.float(), layer.weight.detach(), rtol=0, atol=2e-2)


def test_a_copy_that_gives_nan_is_not_kept():
    from r2r_hf.core.fast.router_copy import RouterCopy, keeps_cast

    model, _, _ = _pair(torch.bfloat16)
    cast = RouterCopy(model.router, torch.bfloat16)
    with torch.no_grad():
        cast.module.combined_projection.weight.fill_(float("nan"))  # an overflowed copy
    assert not keeps_cast(model.slm, cast, model.config.num_topk_logits, *_features(model))


def test_the_check_reads_the_row_with_tokens_and_keeps_fp32_when_there_are_none(tok):
    from r2r_hf.core.fast.router_copy import Scorer
    from r2r_hf.core.layouts.rectangle import Committed

    model, _, _ = _pair(torch.bfloat16)
    enc = tok(PROMPTS, return_tensors="pt", padding=True)
    _fast_scores(model, enc, "model")
    state = model.capture_store.state
    ids = torch.randint(3, 400, (2, 6))
    for mask, kept in ((torch.tensor([[0] * 6, [1] * 6]), True), (torch.zeros(2, 6, dtype=torch.long), False)):
        state.scorer = Scorer(model.router, torch.bfloat16, "model")
        seq = Committed.from_prompt(ids, mask, (mask.cumsum(1) - 1).clamp(min=0), 16)
        state.check_router(seq)  # row 0 is all padding: its features come from row 1, or from none
        assert state.scorer.checked and (state.scorer.cast is not None) == kept


def _replace_router(model, how):
    """Moves the router's weights to new memory as ``how`` does (none written in place)."""
    router = model.router
    if how == "to":
        model.to(torch.bfloat16)  # the router only: the models are not submodules
    elif how == "assign":
        moved = {name: value.clone() * 1.5 for name, value in router.state_dict().items()}
        router.load_state_dict(moved, assign=True)
    else:
        _, last = list(router.named_parameters())[-1]  # the output's bias: shifts every logit
        last.data = last.data + 2.0


@pytest.mark.parametrize("how", ["to", "assign", "data"])
def test_a_router_whose_weights_were_replaced_is_read_as_it_is_now(tok, how):
    """``model.to(dtype)``, ``load_state_dict(assign=True)`` and ``param.data = ...`` put the router's weights in
    new memory: graphs captured over the old memory would score with freed weights (the emulation's replay sees
    the other addresses), so the store captures again, and captured generate scores as eager generate does."""
    model, _, _ = _pair()
    enc = tok(PROMPTS, return_tensors="pt", padding=True)
    threshold = _mixed(model, enc)
    _run(model, enc, threshold)  # captured over the router as it was
    before = model.generate(**enc, **GREEDY, threshold=INF).router_scores
    _replace_router(model, how)
    eager, fast = _run(model, enc, threshold)
    assert not torch.equal(eager.router_scores, before), "the new weights score otherwise"
    assert torch.equal(fast.sequences, eager.sequences) and torch.equal(fast.routed, eager.routed)
    torch.testing.assert_close(fast.router_scores, eager.router_scores, equal_nan=True, **SCORES)
