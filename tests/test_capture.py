"""Every path writes exactly what the eager path writes, on the device at hand.

Paths: eager (dynamic cache), the CUDA-graph fast path (``cache_implementation="static"``) and
the ``torch.compile`` fast path (``compile_config``). On a GPU the graphs are real and compile
uses CUDA graphs (``reduce-overhead``); on a CPU the graphs are emulated (``graph_emulation.py``:
replays overwrite their outputs and a host synchronisation inside a captured step fails, as on a
GPU) and compile uses inductor's default mode. ``benchmarks/gpu_check.sh`` runs this file on CUDA.
"""

import pytest
import torch
from transformers.generation.configuration_utils import CompileConfig

from graph_emulation import HostSyncError, emulate_cuda_graphs
from r2r_hf import R2RForCausalLM
from r2r_hf.core.capture import BUCKETS, bucket_for
from r2r_hf.testing import make_tiny_llm, make_tiny_slm

from conftest import PROMPTS, SMALL_ROUTER

INF = float("inf")
GREEDY = dict(max_new_tokens=14, do_sample=False, pad_token_id=0, eos_token_id=2)
SAMPLING = dict(max_new_tokens=14, do_sample=True, temperature=0.7, top_k=40, pad_token_id=0, eos_token_id=2)
FULL = dict(return_dict_in_generate=True, output_scores=True, output_logits=True)
CUDA = torch.cuda.is_available()
DEVICE = torch.device("cuda" if CUDA else "cpu")
COMPILE = CompileConfig(mode="reduce-overhead" if CUDA else "default")


@pytest.fixture(scope="module")
def pair():
    """A tiny Qwen2 SLM + Llama LLM in fp32 on the device, with a small router (the setup of the CUDA-graph crash)."""
    slm, llm = make_tiny_slm().to(DEVICE), make_tiny_llm().to(DEVICE)
    return R2RForCausalLM.from_models(slm, llm, **SMALL_ROUTER), slm, llm


@pytest.fixture
def graphs(monkeypatch):
    """The CUDA-graph path: real on CUDA, emulated on a CPU; returns the capturing class."""
    from r2r_hf.core.capture import CAPTURERS

    return CAPTURERS["cuda-graph"] if CUDA else emulate_cuda_graphs(monkeypatch)


def _encode(tok, rows: str) -> dict:
    prompts = PROMPTS[:1] if rows == "single" else PROMPTS  # the batch is left-padded
    return {k: v.to(DEVICE) for k, v in tok(prompts, return_tensors="pt", padding=True).items()}


# Every shape compiles anew (inductor), so the compile path runs on the padded batch only: the case
# that crashed under CUDA graphs. The graph path (a capture is one forward) runs on both.
PATHS = [("eager", "single"), ("eager", "batch"), ("graphs", "single"), ("graphs", "batch"), ("compile", "batch")]


def _median_threshold(model, enc):
    probe = model.generate(**enc, **GREEDY, threshold=INF, return_dict_in_generate=True)
    return probe.router_scores[probe.generated_mask].median().item()


def _same(a, b):
    assert torch.equal(a.sequences, b.sequences) and torch.equal(a.routed, b.routed)
    torch.testing.assert_close(a.router_scores, b.router_scores, equal_nan=True, rtol=1e-4, atol=1e-4)
    for x, y in zip(a.scores, b.scores):
        torch.testing.assert_close(x, y, rtol=1e-3, atol=1e-3)
    for x, y in zip(a.logits, b.logits):
        torch.testing.assert_close(x, y, rtol=1e-3, atol=1e-3)


def _argmax_without_cache(m, ids, mask, vocab):
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    return m(input_ids=ids, attention_mask=mask, position_ids=positions).logits[:, -1, :vocab].argmax(-1)


def test_buckets():
    assert [bucket_for(n) for n in (1, 2, 3, 5, 9, 33, 64)] == [1, 2, 4, 8, 16, 64, 64]
    assert bucket_for(BUCKETS[-1] + 1) is None


@pytest.mark.parametrize("path, rows", PATHS)
@pytest.mark.parametrize("sampling", [False, True])
def test_never_and_always_route_equal_each_model(pair, tok, path, rows, sampling, request):
    model, slm, llm = pair
    enc = _encode(tok, rows)
    if path == "graphs":
        request.getfixturevalue("graphs")
    extra = {} if path == "eager" else dict(cache_implementation="static")
    if path == "compile":
        extra["compile_config"] = COMPILE
    kwargs = SAMPLING if sampling else GREEDY
    for threshold, reference in ((INF, slm), (0.0, llm)):
        torch.manual_seed(3)
        expected = reference.generate(**enc, **kwargs)
        after = torch.rand(2, device=DEVICE)
        torch.manual_seed(3)
        got = model.generate(**enc, **kwargs, **extra, threshold=threshold)
        assert torch.equal(got, expected), f"threshold {threshold}"
        assert torch.equal(torch.rand(2, device=DEVICE), after), "the random stream advanced once per token"


@pytest.mark.parametrize("path, rows", [p for p in PATHS if p[0] != "eager"])
def test_mixed_routing_equals_eager_and_a_cache_free_recompute(pair, tok, path, rows, request):
    # The CUDA-graph crash was seen exactly here: mixed routing, static cache, left-padded batch of 2.
    model, _, _ = pair
    enc = _encode(tok, rows)
    extra = dict(cache_implementation="static")
    if path == "graphs":
        request.getfixturevalue("graphs")
    else:
        extra["compile_config"] = COMPILE
    threshold = _median_threshold(model, enc)
    eager = model.generate(**enc, **GREEDY, **FULL, threshold=threshold)
    fast = model.generate(**enc, **GREEDY, **FULL, **extra, threshold=threshold)
    assert model.capture_store.state is not None and model.capture_store.state._slm_step is not None
    assert fast.routed[fast.generated_mask].any() and (~fast.routed[fast.generated_mask]).any()
    _same(fast, eager)
    prompt = enc["input_ids"].shape[1]
    mask = torch.cat([enc["attention_mask"], torch.ones_like(fast.sequences[:, prompt:])], dim=1)
    for t in range(fast.sequences.shape[1] - prompt):
        ids = fast.sequences[:, : prompt + t]
        for writer, rows in ((model.llm, fast.routed[:, t]), (model.slm, ~fast.routed[:, t] & fast.generated_mask[:, t])):
            if rows.any():
                want = _argmax_without_cache(writer, ids, mask[:, : prompt + t], model.shared_vocab_size)
                assert torch.equal(want[rows], fast.sequences[rows, prompt + t]), f"step {t}"
    # A second call reuses the captured steps and their caches.
    again = model.generate(**enc, **GREEDY, **FULL, **extra, threshold=threshold)
    _same(again, eager)


def test_catch_up_is_bucketed_and_the_prompt_chunk_runs_eagerly(pair, tok, graphs):
    model, _, _ = pair
    enc = {k: v.to(DEVICE) for k, v in tok([" ".join(["the old man said that he was"] * 12)], return_tensors="pt").items()}
    assert enc["input_ids"].shape[1] > BUCKETS[-1], "the first chunk holds the prompt: longer than every bucket"
    threshold = _median_threshold(model, enc)
    eager = model.generate(**enc, **GREEDY, **FULL, threshold=threshold)
    model.capture_store.clear()
    captured = model.generate(**enc, **GREEDY, **FULL, threshold=threshold, cache_implementation="static")
    _same(captured, eager)
    routed_steps = captured.routed[0].nonzero().flatten().tolist()
    gaps = {b - a for a, b in zip(routed_steps, routed_steps[1:])}
    assert set(model.capture_store.state._llm_chunks) == {bucket_for(g) for g in gaps}, "later catch-ups are buckets"


@pytest.mark.skipif(CUDA, reason="the emulation counts captures and checks host syncs; on CUDA a sync fails the capture itself")
def test_captures_are_reused_and_host_synchronisation_is_caught(pair, tok, monkeypatch):
    from r2r_hf.core import capture

    model, _, _ = pair
    enc = _encode(tok, "batch")
    steps = emulate_cuda_graphs(monkeypatch)
    model.capture_store.clear()
    model.generate(**enc, **GREEDY, threshold=0.5, cache_implementation="static")
    before = steps.captures
    model.generate(**enc, **GREEDY, threshold=0.5, cache_implementation="static")
    assert steps.captures == before, "same shapes: nothing captured again"
    real = capture.router_fn

    def syncing_router(slm, router, k):
        route = real(slm, router, k)
        return lambda logits, hidden, token: (route(logits, hidden, token)[0] * (logits.sum() > 0).item(),)

    monkeypatch.setattr(capture, "router_fn", syncing_router)
    model.capture_store.clear()
    with pytest.raises(HostSyncError):
        model.generate(**enc, **GREEDY, threshold=0.5, cache_implementation="static")
    model.capture_store.clear()


def test_stateful_routers_run_eagerly_on_the_fast_path(pair, graphs):
    _, slm, llm = pair
    random = R2RForCausalLM.from_models(slm, llm, router_type="random", threshold=0.5)
    ids = torch.tensor([[5, 6, 7]], device=DEVICE)
    eager = random.generate(ids, **GREEDY, return_dict_in_generate=True)
    fast = random.generate(ids, **GREEDY, return_dict_in_generate=True, cache_implementation="static")
    assert torch.equal(fast.routed, eager.routed) and random.capture_store.state._route is None


def test_disable_compile_and_dynamic_cache_stay_eager(pair, graphs):
    model, _, _ = pair
    ids = torch.tensor([[5, 6, 7]], device=DEVICE)
    model.capture_store.clear()
    model.generate(ids, **GREEDY, cache_implementation="static", disable_compile=True)
    model.generate(ids, **GREEDY)
    assert model.capture_store.state is None
