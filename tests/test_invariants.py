"""The correctness backbone: R2R reduces to each model at the extremes and never drifts in between."""

import pytest
import torch

from r2r_hf.testing.agreement import argmax_without_cache as _argmax_without_cache

INF = float("inf")
GREEDY = dict(max_new_tokens=14, do_sample=False, pad_token_id=0, eos_token_id=2)
SAMPLING = dict(max_new_tokens=14, do_sample=True, temperature=0.7, top_k=40, top_p=0.9, pad_token_id=0, eos_token_id=2)


def _inputs(request, name):
    return request.getfixturevalue(name)  # "single" (batch 1) or "batch" (left-padded, 2 rows)


@pytest.mark.parametrize("inputs", ["single", "batch"])
def test_never_route_equals_slm_generate_greedy(model, slm, inputs, request):
    enc = _inputs(request, inputs)
    expected = slm.generate(**enc, **GREEDY)
    out = model.generate(**enc, **GREEDY, threshold=INF, return_dict_in_generate=True)
    assert torch.equal(out.sequences, expected)
    assert not out.routed.any() and out.llm_token_rate == 0.0


@pytest.mark.parametrize("inputs", ["single", "batch"])
def test_always_route_equals_llm_generate_greedy(model, llm, inputs, request):
    enc = _inputs(request, inputs)
    expected = llm.generate(**enc, **GREEDY)
    out = model.generate(**enc, **GREEDY, threshold=0.0, return_dict_in_generate=True)
    assert torch.equal(out.sequences, expected)
    assert out.routed[out.generated_mask].all() and out.llm_token_rate == 1.0


@pytest.mark.parametrize("inputs", ["single", "batch"])
@pytest.mark.parametrize("seed", [0, 7])
def test_sampling_keeps_hf_random_stream(model, slm, llm, inputs, seed, request):
    enc = _inputs(request, inputs)
    for threshold, reference in ((INF, slm), (0.0, llm)):
        torch.manual_seed(seed)
        expected = reference.generate(**enc, **SAMPLING)
        stream_after_reference = torch.rand(3)
        torch.manual_seed(seed)
        got = model.generate(**enc, **SAMPLING, threshold=threshold)
        assert torch.equal(got, expected), f"threshold={threshold}"
        # One draw per committed token: the global stream ends where the reference left it.
        assert torch.equal(torch.rand(3), stream_after_reference)


def test_row_that_hits_eos_early_is_padded_and_never_routed(model, slm, batch):
    free = slm.generate(**batch, max_new_tokens=10, do_sample=False, pad_token_id=0, eos_token_id=2)
    prompt = batch["input_ids"].shape[1]
    eos = int(free[1, prompt + 2])  # row 1 ends after its third token; row 0 must not contain it earlier
    assert eos not in free[0, prompt : prompt + 10].tolist() or pytest.skip("fixture produced a shared token")
    kwargs = dict(max_new_tokens=10, do_sample=False, pad_token_id=0, eos_token_id=eos)
    expected = slm.generate(**batch, **kwargs)
    out = model.generate(**batch, **kwargs, threshold=INF, return_dict_in_generate=True)
    assert torch.equal(out.sequences, expected)
    row = out.sequences[1, prompt:]
    assert (row[3:] == 0).all(), "tokens after EOS are padding"
    assert out.generated_mask[1].tolist() == [True] * 3 + [False] * (len(row) - 3)
    assert torch.isnan(out.router_scores[1, 3:]).all()
    # Always-route: the finished row is never routed again.
    routed = model.generate(**batch, **kwargs, threshold=0.0, return_dict_in_generate=True)
    assert not routed.routed[~routed.generated_mask].any()


@pytest.mark.parametrize("inputs", ["single", "batch"])
def test_mixed_routing_equals_cache_free_recompute(model, inputs, request):
    enc = _inputs(request, inputs)
    # An untrained router: pick the threshold at the median score so both models write.
    probe = model.generate(**enc, **GREEDY, threshold=INF, return_dict_in_generate=True)
    threshold = probe.router_scores[probe.generated_mask].median().item()
    out = model.generate(**enc, **GREEDY, threshold=threshold, return_dict_in_generate=True)
    assert torch.equal(out.routed, (out.router_scores >= threshold) & out.generated_mask)
    assert out.routed[out.generated_mask].any() and (~out.routed[out.generated_mask]).any()
    prompt = enc["input_ids"].shape[1]
    mask = torch.cat([enc["attention_mask"], torch.ones_like(out.sequences[:, prompt:])], dim=1)
    checked = 0
    for t in range(out.sequences.shape[1] - prompt):
        ids = out.sequences[:, : prompt + t]
        for writer, rows in ((model.llm, out.routed[:, t]), (model.slm, ~out.routed[:, t] & out.generated_mask[:, t])):
            if rows.any():
                want = _argmax_without_cache(writer, ids, mask[:, : prompt + t], model.shared_vocab_size)
                assert torch.equal(want[rows], out.sequences[rows, prompt + t]), f"step {t}"
                checked += int(rows.sum())
    assert checked == int(out.generated_mask.sum())
    expected_rate = out.routed.sum().item() / out.generated_mask.sum().item()
    assert out.llm_token_rate == pytest.approx(expected_rate)


@pytest.mark.parametrize("threshold", [INF, 0.0, "median"])
def test_static_cache_matches_dynamic_cache(model, batch, threshold):
    if threshold == "median":
        probe = model.generate(**batch, **GREEDY, threshold=INF, return_dict_in_generate=True)
        threshold = probe.router_scores[probe.generated_mask].median().item()
    dynamic = model.generate(**batch, **GREEDY, threshold=threshold)
    static = model.generate(**batch, **GREEDY, threshold=threshold, cache_implementation="static")
    assert torch.equal(dynamic, static)


def test_per_call_threshold_changes_nothing_stored(model, single):
    before = model.config.threshold
    model.generate(**single, **GREEDY, threshold=0.0)
    assert model.config.threshold == before


@pytest.mark.compile
def test_compiled_static_step_equals_eager(model, batch):
    """The compiled SLM + router step (static cache) writes the same tokens and routes the same way."""
    from transformers.generation.configuration_utils import CompileConfig

    probe = model.generate(**batch, **GREEDY, threshold=INF, return_dict_in_generate=True)
    threshold = probe.router_scores[probe.generated_mask].median().item()
    kwargs = dict(**GREEDY, threshold=threshold, cache_implementation="static", return_dict_in_generate=True)
    eager = model.generate(**batch, **kwargs)
    compiled = model.generate(**batch, **kwargs, compile_config=CompileConfig(mode="default"))
    assert model.capture_store.state is not None and ("slm", 1) in model.capture_store.state.buckets, \
        "the compiled path ran"
    assert torch.equal(compiled.sequences, eager.sequences) and torch.equal(compiled.routed, eager.routed)
    torch.testing.assert_close(compiled.router_scores, eager.router_scores, equal_nan=True, rtol=1e-5, atol=1e-5)
