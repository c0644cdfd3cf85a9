"""Fused captured reads (issue 32): HF's decoder layers as one compiled region per layer, captured whole.

The regions' math must be HF's (plain, bit for bit in fp32); through inductor and emulated CUDA graphs
(``r2r_hf/testing/graphs.py``: host syncs fail, replays must take the captured path, outputs are overwritten)
``generate`` must write what eager ``generate`` writes, token for token, never-, always- and mixed-routed,
greedy and seeded, one row and a padded batch, with attention over fewer columns than the cache holds; one
compiled region serves every layer; what cannot be fused captures HF's forward and says why.
"""

import logging

import pytest
import torch
import transformers
from packaging.version import Version
from conftest import PROMPTS, SMALL_ROUTER

from r2r_hf import R2RForCausalLM
from r2r_hf.core.fast import fused
from r2r_hf.core.fast import fused_reads
from r2r_hf.core.fast.static_reads import read_fn, static_cache
from r2r_hf.core.abilities import abilities
from r2r_hf.core.fast.fused_reads import PLAIN, static_read
from r2r_hf.testing import make_tiny_llm, make_tiny_slm
from r2r_hf.testing.graphs import EmulatedGraphStep, emulated_store

INF = float("inf")
GREEDY = dict(max_new_tokens=12, do_sample=False, pad_token_id=0, eos_token_id=2)
SAMPLING = dict(max_new_tokens=12, do_sample=True, temperature=0.8, top_k=40, pad_token_id=0, eos_token_id=2)
FULL = dict(return_dict_in_generate=True, output_logits=True)


@pytest.fixture(scope="module")
def pair():
    """Its own tiny Qwen2 + Llama pair (the compiled regions are kept on the models)."""
    slm, llm = make_tiny_slm(), make_tiny_llm()
    return R2RForCausalLM.from_models(slm, llm, **SMALL_ROUTER), slm, llm


@pytest.fixture
def fused_graphs(pair, monkeypatch):
    """Emulated graphs of fused reads; attention spans from 8 columns, so a read attends less than the cache."""
    step = type("Step", (EmulatedGraphStep,), {"captures": 0})
    monkeypatch.setattr(pair[0], "capture_store", emulated_store(step, fuse=True))
    monkeypatch.setattr(fused, "MIN_ATTENDED", 8)
    return step


def _reads(model, cache, ids, mask, make):
    positions = (mask.cumsum(1) - 1).clamp(min=0)
    read = make(model, cache)
    out = []
    with torch.inference_mode():
        for start, width in ((0, 8), (8, 1), (9, 4)):
            out.append(read(ids[:, start : start + width], positions[:, start : start + width], mask,
                            torch.tensor([width - 1]), torch.tensor(0)))
    return out


@pytest.mark.parametrize("make_model", [make_tiny_slm, make_tiny_llm], ids=["qwen2", "llama"])
def test_the_regions_compute_what_hf_computes_bit_for_bit(make_model):
    model = make_model().eval()
    assert abilities(model).fuse is None
    ids = torch.randint(3, 400, (2, 24))
    mask = torch.ones(2, 24, dtype=torch.long)
    mask[0, :3] = 0  # a left-padded row
    hf = _reads(model, static_cache(model, 2, 24), ids, mask, lambda m, c: read_fn(m, c, True))
    ours = _reads(model, static_cache(model, 2, 24), ids, mask, lambda m, c: static_read(m, c, True, 16, PLAIN))
    # Bit for bit on transformers 5.24 (checked there); 5.17's attention orders its sums differently after the
    # first read (measured: up to 6e-6 on logits of ~31, fp32 rounding), so older releases are held to rounding.
    exact = Version(transformers.__version__) >= Version("5.24")
    for a, b in zip(hf, ours):
        for x, y in zip(a, b):
            if exact:
                assert torch.equal(x, y), "the plain regions are HF's forward"
            else:
                torch.testing.assert_close(y, x, rtol=1e-6, atol=1e-5)


def _generate(model, enc, threshold, sampling, **extra):
    torch.manual_seed(5)
    return model.generate(**enc, **(SAMPLING if sampling else GREEDY), **FULL, threshold=threshold, **extra)


def _same(fast, eager):
    assert torch.equal(fast.sequences, eager.sequences) and torch.equal(fast.routed, eager.routed)
    torch.testing.assert_close(fast.router_scores, eager.router_scores, equal_nan=True, rtol=1e-4, atol=1e-4)
    for x, y in zip(fast.logits, eager.logits):
        torch.testing.assert_close(x, y, rtol=1e-3, atol=1e-3)


@pytest.mark.parametrize("rows", ["single", "batch"])
def test_fused_generate_on_emulated_graphs_writes_what_eager_generate_writes(pair, tok, fused_graphs, rows):
    model, slm, llm = pair
    enc = tok(PROMPTS[:1] if rows == "single" else PROMPTS, return_tensors="pt", padding=True)
    probe = model.generate(**enc, **GREEDY, threshold=INF, return_dict_in_generate=True)
    scores = probe.router_scores[probe.generated_mask].sort().values
    middle = len(scores) // 2
    mixed = ((scores[middle - 1] + scores[middle]) / 2).item()  # between two scores, not on one
    for sampling in (False, True):
        for threshold, alone in ((INF, slm), (0.0, llm), (mixed, None)):
            eager = _generate(model, enc, threshold, sampling)
            fast = _generate(model, enc, threshold, sampling, cache_implementation="static")
            _same(fast, eager)
            if alone is not None:
                torch.manual_seed(5)
                assert torch.equal(fast.sequences, alone.generate(**enc, **(SAMPLING if sampling else GREEDY)))
    state = model.capture_store.state
    assert all(regions is not None for regions in state.fused.values()), "both models' reads ran fused"
    spans = {span for _, _, span, *_ in state.reads}
    assert min(spans) < state.capacity, "some reads attended fewer columns than the cache holds"
    assert fused_graphs.captures > 0


def test_one_compiled_region_serves_every_layer(pair, tok, fused_graphs):
    model, _, llm = pair
    enc = tok(PROMPTS, return_tensors="pt", padding=True)
    _generate(model, enc, 0.0, False, cache_implementation="static")
    layer = fused_reads.compiled_regions(llm).functions["static_layer"]
    entries = torch._dynamo.eval_frame._debug_get_cache_entry_list(layer.__code__)
    assert llm.config.num_hidden_layers == 3 and 1 <= len(entries) <= 4, \
        "one compiled entry per shape class (1 or more rows x 1 or more tokens), not one per layer"


def test_a_model_that_cannot_be_fused_captures_hfs_forward_and_says_why(tok, caplog, monkeypatch):
    slm, llm = make_tiny_slm(), make_tiny_llm()
    llm.config.model_type = "not-a-decoder-we-fuse"
    model = R2RForCausalLM.from_models(slm, llm, **SMALL_ROUTER)
    monkeypatch.setattr(model, "capture_store", emulated_store(fuse=True))
    enc = tok(PROMPTS, return_tensors="pt", padding=True)
    with caplog.at_level(logging.WARNING):
        fast = _generate(model, enc, 0.0, False, cache_implementation="static")
    _same(fast, _generate(model, enc, 0.0, False))
    state = model.capture_store.state
    assert state.fused["llm"] is None and state.fused["slm"] is not None
    assert any("not-a-decoder-we-fuse" in r.getMessage() and "HF forward" in r.getMessage() for r in caplog.records)


def test_a_variant_whose_forward_differs_is_not_fused():
    model = make_tiny_slm()
    plain = model.forward
    model.forward = lambda *a, **k: plain(*a, **k).__class__(logits=plain(*a, **k).logits * 2)  # not what we compute
    assert abilities(model).fuse == "its fused logits differ from its own forward"


def test_the_self_check_allows_the_rounding_another_exact_read_shows():
    """A deep bf16 model departs from its own plain forward by rounding alone (the random 32B's captured HF reads by
    8 % on the H200): the fused read is judged against twice what HF's slot read departs by, a wrong one still not."""
    from r2r_hf.core.probes import slot_read_problem, fuse_problem

    model = make_tiny_slm()
    off = lambda by: lambda cache, tokens: model(input_ids=tokens[1:], use_cache=False).logits[0, -1] * (1 + by)  # noqa
    found = {}
    assert slot_read_problem(model, off(0.06), "failed", "differs", found) == "differs"
    assert abs(found["max_rel"] - 0.06) < 1e-3 and found["tolerance"] == 1e-3
    assert slot_read_problem(model, off(0.06), "failed", "differs", found, rounding=0.04) is None
    assert found["tolerance"] == 0.08
    assert slot_read_problem(model, off(1.0), "failed", "differs", {}, rounding=0.04) == "differs"
    # the fused check takes HF's own slot read's gap as the slot probe measured it (the device check writes both down)
    assert abilities(model).slots is None and abilities(model).fuse is None
    measured = dict(abilities(model).measured)
    assert measured["slot_read_max_rel"] < 1e-5
    assert measured["fuse_max_rel"] <= measured["fuse_tolerance"] == 1e-3
    measured["slot_read_max_rel"] = 0.04  # as a deep bf16 model's slot read departs
    assert fuse_problem(model, measured, slots=True) is None and measured["fuse_tolerance"] == 0.08


def test_fused_captures_compile_past_dynamos_default_recompile_limit(monkeypatch):
    """One model's region meets up to 4 shape classes per kind of read (static and slot, with the hidden state or
    not): on the H200 the SLM's head reached dynamo's default limit of 8 in a process that ran generate and served,
    and the server fell back to HF's forward. A fused capture compiles under a limit that covers them all."""
    import torch._dynamo.config as config

    before, seen = config.recompile_limit, []
    fused_reads.capture_fused(lambda step, example: seen.append((config.recompile_limit,
                                                                config.fail_on_recompile_limit_hit)), lambda: None,
                              {}, "a model")
    assert seen == [(32, True)], "4 shape classes x the kinds of read that share a region, and a hit is an error"
    assert config.recompile_limit == before, "the limit is raised while the capture lasts only"


def test_a_region_that_fails_to_compile_falls_back_to_hfs_forward(tok, caplog, monkeypatch):
    slm, llm = make_tiny_slm(), make_tiny_llm()
    model = R2RForCausalLM.from_models(slm, llm, **SMALL_ROUTER)
    monkeypatch.setattr(model, "capture_store", emulated_store(fuse=True))

    def broken(*args):
        raise RuntimeError("inductor could not build this kernel")

    for m in (slm, llm):
        fused_reads.compiled_regions(m).static_prologue = broken
    enc = tok(PROMPTS, return_tensors="pt", padding=True)
    with caplog.at_level(logging.WARNING):
        fast = _generate(model, enc, 0.0, False, cache_implementation="static")
    _same(fast, _generate(model, enc, 0.0, False))
    assert model.capture_store.state.fused == {"slm": None, "llm": None}
    assert any("did not compile" in r.getMessage() and "inductor could not build" in r.getMessage()
               for r in caplog.records)


def test_packed_weights_are_views_of_the_models_own_and_save_and_train_as_before(tmp_path):
    model = make_tiny_slm()
    before = {name: value.clone() for name, value in model.state_dict().items()}
    with torch.inference_mode():  # as the capture packs them
        qkv, _, gate_up, _ = fused.layer_weights(model.model.layers[0])
    attn, mlp = model.model.layers[0].self_attn, model.model.layers[0].mlp
    assert attn.q_proj.weight.data_ptr() == qkv.data_ptr() and mlp.gate_proj.weight.data_ptr() == gate_up.data_ptr()
    assert torch.equal(attn.v_proj.weight, before["model.layers.0.self_attn.v_proj.weight"])
    model.save_pretrained(tmp_path)
    again = type(model).from_pretrained(tmp_path)
    assert all(torch.equal(value, before[name]) for name, value in again.state_dict().items())
    model.train()
    ids = torch.tensor([[5, 6, 7, 8]])
    model(input_ids=ids, labels=ids).loss.backward()  # not inference tensors: a training step still works
    assert attn.k_proj.weight.grad is not None and mlp.up_proj.weight.grad is not None


@pytest.mark.parametrize("fuse", [True, False], ids=["fused", "hf-forward"])
def test_weights_replaced_between_calls_are_read_as_they_are_now(pair, tok, monkeypatch, fuse):
    """``weight.data = new`` (EMA, some weight loaders) and ``load_state_dict(assign=True)`` move a model's weights:
    the captured calls (fused reads over packed weights, or graphs of HF's forward) must read the new ones."""
    model, slm, llm = pair
    monkeypatch.setattr(model, "capture_store", emulated_store(fuse=fuse))
    monkeypatch.setattr(fused, "MIN_ATTENDED", 8)
    enc = tok(PROMPTS, return_tensors="pt", padding=True)
    before = _generate(model, enc, 0.0, False, cache_implementation="static")
    up, kept = llm.model.layers[0].mlp.up_proj, llm.model.layers[0].mlp.up_proj.weight.data
    original = {name: value for name, value in slm.state_dict().items()}
    try:
        up.weight.data = kept * -3  # a new tensor, not a write into the old one
        eager = _generate(model, enc, 0.0, False)
        assert not torch.equal(eager.sequences, before.sequences), "the new weight changes the LLM's answer"
        _same(_generate(model, enc, 0.0, False, cache_implementation="static"), eager)
        moved = {name: value.clone() * (1.5 if "layers.0.self_attn.q_proj" in name else 1.0)
                 for name, value in original.items()}
        slm.load_state_dict(moved, assign=True)  # every SLM parameter replaced
        _same(_generate(model, enc, INF, False, cache_implementation="static"), _generate(model, enc, INF, False))
    finally:
        up.weight.data = kept
        slm.load_state_dict(original, assign=True)
