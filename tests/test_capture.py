"""Every path writes exactly what the eager path writes, on the device at hand.

Paths: eager (dynamic cache), the CUDA-graph fast path (``cache_implementation="static"``) and
the ``torch.compile`` fast path (``compile_config``). On a GPU the graphs are real and compile
uses CUDA graphs (``reduce-overhead``); on a CPU the graphs are emulated (``graph_emulation.py``:
replays overwrite their outputs and a host synchronisation inside a captured step fails, as on a
GPU; ``r2r_hf/testing/graphs.py``) and compile uses inductor's default mode. ``benchmarks/gpu/check.sh``
runs this file on CUDA (without the compile cases, which cost minutes there: ``-m "not compile"``), every model's
graphs of HF's forward (fusing off: a fused region's cold compile costs tens of seconds there).
"""

import pytest
import torch
from transformers.generation.configuration_utils import CompileConfig

from r2r_hf import R2RForCausalLM
from r2r_hf.core.fast.static_reads import BUCKETS, bucket_for, pieces
from r2r_hf.core.fast.graphs import CudaGraphStep
from r2r_hf.testing import make_tiny_llm, make_tiny_slm
from r2r_hf.testing.agreement import argmax_without_cache as _argmax_without_cache
from r2r_hf.testing.graphs import EmulatedGraphStep, HostSyncError, emulated_store

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
    model = R2RForCausalLM.from_models(slm, llm, **SMALL_ROUTER)
    if CUDA:  # every CUDA test on graphs of HF's forward (``_on_device`` says why)
        model.capture_store.fuse = False
    return model, slm, llm


def _emulate(model, monkeypatch) -> type[EmulatedGraphStep]:
    """``model`` captures on the CPU with emulated graphs of their own class (its ``captures`` count)."""
    step = type("Step", (EmulatedGraphStep,), {"captures": 0})
    monkeypatch.setattr(model, "capture_store", emulated_store(step))
    return step


def _on_device(model, monkeypatch) -> None:
    """``model``'s graphs: emulated on a CPU; on CUDA real, of HF's forward (a model's default store fuses, and each
    fused region compiles for tens of seconds cold: more than the device check gives these tests, which prove the
    paths; the check's own phases measure the fused reads)."""
    if CUDA:
        monkeypatch.setattr(model.capture_store, "fuse", False)
    else:
        _emulate(model, monkeypatch)


@pytest.fixture
def graphs(pair, monkeypatch):
    """The CUDA-graph path for the pair's model: real on CUDA, emulated on a CPU; returns the capturing class.

    Graphs of HF's forward: the fused reads compile for tens of seconds cold (tests/test_fused.py checks them on
    emulated graphs; the device check's phases on CUDA), more than the device check gives these tests."""
    if CUDA:
        monkeypatch.setattr(pair[0].capture_store, "fuse", False)
        return CudaGraphStep
    return _emulate(pair[0], monkeypatch)


def _encode(tok, rows: str) -> dict:
    prompts = PROMPTS[:1] if rows == "single" else PROMPTS  # the batch is left-padded
    return {k: v.to(DEVICE) for k, v in tok(prompts, return_tensors="pt", padding=True).items()}


# Every shape compiles anew (inductor), so the compile path runs on the padded batch only: the case
# that crashed under CUDA graphs. The graph path (a capture is one forward) runs on both.
CAPTURED = [("graphs", "single"), ("graphs", "batch"), pytest.param("compile", "batch", marks=pytest.mark.compile)]
PATHS = [("eager", "single"), ("eager", "batch"), *CAPTURED]


def _thresholds(model, enc, n: int = 1) -> list[float]:
    """``n`` thresholds for mixed routing, each halfway across one of the ``n`` widest gaps between neighbouring
    scores (of the never-route probe's middle 20-80 %). Not a score itself, as a median is: routing is
    ``score >= threshold``, and a score that rounds one ulp lower on a GPU's kernels would route otherwise."""
    probe = model.generate(**enc, **GREEDY, threshold=INF, return_dict_in_generate=True)
    scores = probe.router_scores[probe.generated_mask].float().sort().values
    low, high = int(0.2 * (len(scores) - 1)), int(0.8 * (len(scores) - 1))
    gaps = scores[low + 1 : high + 1] - scores[low:high]
    widest = gaps.topk(n).indices
    assert (gaps[widest] > 0).all(), "the probe's scores leave room between them"
    return sorted(((scores[low + i] + scores[low + i + 1]) / 2).item() for i in widest.tolist())


def _middle_threshold(model, enc) -> float:
    """One threshold in the middle of the scores, between two of them (``_thresholds``)."""
    return _thresholds(model, enc)[0]


def _same(a, b):
    assert torch.equal(a.sequences, b.sequences) and torch.equal(a.routed, b.routed)
    torch.testing.assert_close(a.router_scores, b.router_scores, equal_nan=True, rtol=1e-4, atol=1e-4)
    for x, y in zip(a.scores, b.scores):
        torch.testing.assert_close(x, y, rtol=1e-3, atol=1e-3)
    for x, y in zip(a.logits, b.logits):
        torch.testing.assert_close(x, y, rtol=1e-3, atol=1e-3)


def test_buckets_and_pieces():
    assert [bucket_for(n) for n in (1, 2, 3, 5, 9, 33, 64)] == [1, 2, 4, 8, 16, 64, 64]
    assert pieces(5) == [(5, 8)] and pieces(64) == [(64, 64)]
    assert pieces(150) == [(64, 64), (64, 64), (22, 32)], "long reads: full 64-token pieces, then the rest"
    assert sum(t for t, _ in pieces(1000)) == 1000 and all(t <= b <= BUCKETS[-1] for t, b in pieces(1000))


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


@pytest.mark.parametrize("path, rows", CAPTURED)
def test_mixed_routing_equals_eager_and_a_cache_free_recompute(pair, tok, path, rows, request):
    # The CUDA-graph crash was seen exactly here: mixed routing, static cache, left-padded batch of 2.
    model, _, _ = pair
    enc = _encode(tok, rows)
    extra = dict(cache_implementation="static")
    if path == "graphs":
        request.getfixturevalue("graphs")
    else:
        extra["compile_config"] = COMPILE
    threshold = _middle_threshold(model, enc)
    eager = model.generate(**enc, **GREEDY, **FULL, threshold=threshold)
    fast = model.generate(**enc, **GREEDY, **FULL, **extra, threshold=threshold)
    assert model.capture_store.state is not None and ("slm", 1) in model.capture_store.state.buckets
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


def test_long_reads_are_captured_piece_by_piece(pair, tok, graphs):
    model, _, _ = pair
    enc = {k: v.to(DEVICE) for k, v in tok([" ".join(["the old man said that he was"] * 12)], return_tensors="pt").items()}
    assert enc["input_ids"].shape[1] > BUCKETS[-1], "the prompt is longer than every bucket"
    threshold = _middle_threshold(model, enc)
    eager = model.generate(**enc, **GREEDY, **FULL, threshold=threshold)
    model.capture_store.clear()
    captured = model.generate(**enc, **GREEDY, **FULL, threshold=threshold, cache_implementation="static")
    _same(captured, eager)
    reads = set(model.capture_store.state.buckets)
    prompt_pieces = {b for _, b in pieces(enc["input_ids"].shape[1])}
    assert {("slm", b) for b in prompt_pieces} | {("slm", 1)} == {r for r in reads if r[0] == "slm"}, \
        "the SLM reads the prompt in captured pieces, then one token per step"
    routed_steps = captured.routed[0].nonzero().flatten().tolist()
    first = enc["input_ids"].shape[1] + routed_steps[0]  # the LLM's first read: prompt + tokens before it
    gaps = [b - a for a, b in zip(routed_steps, routed_steps[1:])]
    expected = {b for g in [first, *gaps] for _, b in pieces(g)}
    assert {b for role, b in reads if role == "llm"} == expected, "every catch-up, the prompt's too, is captured"


def test_a_read_longer_than_the_buckets_in_the_middle_of_an_answer(pair, tok, graphs):
    from benchmarks.speed.parts import ForcedRouter

    model, _, _ = pair
    enc = _encode(tok, "batch")
    steps = BUCKETS[-1] + 24
    kwargs = dict(max_new_tokens=steps, min_new_tokens=steps, do_sample=False, pad_token_id=0, **FULL)
    # Route every row at the first step and at step 90 only: that catch-up reads 90 tokens the LLM has not seen.
    forced = ForcedRouter(model.router, 2, steps)
    schedule = torch.zeros(steps, 2, dtype=torch.bool)
    schedule[0] = schedule[BUCKETS[-1] + 20] = True
    forced.set_schedule(schedule)
    real, model.router = model.router, forced
    try:
        eager = model.generate(**enc, **kwargs, threshold=0.5)
        model.capture_store.clear()
        captured = model.generate(**enc, **kwargs, threshold=0.5, cache_implementation="static")
    finally:
        model.router = real
    assert torch.equal(captured.routed, schedule.T.to(DEVICE))
    _same(captured, eager)
    assert ("llm", BUCKETS[-1]) in model.capture_store.state.buckets


@pytest.mark.skipif(CUDA, reason="the emulation counts captures; on CUDA the same calls run on real graphs")
def test_captures_are_reused(pair, tok, graphs):
    model, _, _ = pair
    enc = _encode(tok, "batch")
    model.generate(**enc, **GREEDY, threshold=0.5, cache_implementation="static")
    before = graphs.captures
    model.generate(**enc, **GREEDY, threshold=0.5, cache_implementation="static")
    assert graphs.captures == before, "same shapes: nothing captured again"


def test_stateful_routers_run_eagerly_on_the_fast_path(pair, monkeypatch):
    _, slm, llm = pair
    random = R2RForCausalLM.from_models(slm, llm, router_type="random", threshold=0.5)
    _on_device(random, monkeypatch)
    ids = torch.tensor([[5, 6, 7]], device=DEVICE)
    eager = random.generate(ids, **GREEDY, return_dict_in_generate=True)
    fast = random.generate(ids, **GREEDY, return_dict_in_generate=True, cache_implementation="static")
    assert torch.equal(fast.routed, eager.routed) and random.capture_store.state.router_step is None


def test_disable_compile_and_dynamic_cache_stay_eager(pair, graphs):
    model, _, _ = pair
    ids = torch.tensor([[5, 6, 7]], device=DEVICE)
    model.capture_store.clear()
    model.generate(ids, **GREEDY, cache_implementation="static", disable_compile=True)
    model.generate(ids, **GREEDY)
    assert model.capture_store.state is None


# ------------------------------------------------------------------ what may be captured
@pytest.mark.parametrize("change, reason", [
    (dict(_attn_implementation="flash_attention_2"), "attention is 'flash_attention_2'"),
    (dict(rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0}), "rotary embedding"),
    (dict(rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0}), "rotary embedding"),
])
def test_only_sdpa_or_eager_attention_and_static_rope_are_captured(change, reason, monkeypatch, caplog):
    from r2r_hf.core.probes import capture_problem

    slm = make_tiny_slm()
    assert capture_problem(slm) is None
    for name, value in change.items():
        monkeypatch.setattr(slm.config, name, value)
    assert reason in capture_problem(slm)
    if "attention" in reason:
        return  # flash attention itself does not run on a CPU; the refusal is what is checked
    model = R2RForCausalLM.from_models(slm, make_tiny_llm(), **SMALL_ROUTER)
    _on_device(model, monkeypatch)
    model.to(DEVICE), slm.to(DEVICE), model.llm.to(DEVICE)
    ids = torch.tensor([[5, 6, 7]], device=DEVICE)
    with caplog.at_level("WARNING", logger="r2r_hf.core.fast.store"):
        for _ in range(3):
            model.generate(ids, **GREEDY, cache_implementation="static")
    assert model.capture_store.state is None, "the call ran eagerly"
    warnings = [r.message for r in caplog.records if "cannot be captured" in r.message]
    assert len(warnings) == 1 and reason in warnings[0], "the reason is said once"


# ------------------------------------------------------------------ concurrent calls
def test_concurrent_calls_on_the_fast_path_equal_the_serial_ones(pair, tok, graphs):
    from test_concurrency import _in_threads

    model, _, _ = pair
    enc = _encode(tok, "batch")
    thresholds = _thresholds(model, enc, 6)
    kwargs = dict(GREEDY, return_dict_in_generate=True, cache_implementation="static")

    def call(threshold):
        out = model.generate(**enc, **kwargs, threshold=threshold)
        return out.sequences, out.routed

    serial = [call(t) for t in thresholds]
    assert any(r.any() and not r.all() for _, r in serial), "mixed routing"
    for (want_seq, want_routed), (got_seq, got_routed) in zip(serial, _in_threads(call, thresholds)):
        assert torch.equal(got_seq, want_seq) and torch.equal(got_routed, want_routed)


def test_a_generate_inside_a_streamer_runs_eagerly_instead_of_waiting_for_itself(pair, tok, graphs, caplog):
    from transformers.generation.streamers import BaseStreamer

    model, _, _ = pair
    enc = _encode(tok, "single")
    inner, puts = [], []

    class Nested(BaseStreamer):
        def put(self, value):  # the first put is the prompt (before the loop); the second, the loop's first token
            puts.append(value)
            if len(puts) == 2:
                inner.append(model.generate(**enc, **GREEDY, cache_implementation="static"))

        def end(self):
            pass

    expected = model.generate(**enc, **GREEDY)
    with caplog.at_level("WARNING", logger="r2r_hf.core.fast.store"):
        outer = model.generate(**enc, **GREEDY, cache_implementation="static", streamer=Nested())
    assert torch.equal(outer, expected) and torch.equal(inner[0], expected)
    assert any("same thread" in r.message for r in caplog.records)


# ------------------------------------------------------------------ numerics, teacher-forced
def _engines(model, batch: int, capacity: int):
    from r2r_hf.core.layouts.model_calls import EagerCalls

    eager = EagerCalls(model.slm, model.llm, model.router, model.config.num_topk_logits, None, capacity)
    captured = model.capture_store.lend(model.routed_pair(), None, batch, capacity)
    return eager, captured


def test_teacher_forced_logits_of_captured_reads_equal_eager_in_fp32(pair, graphs):
    from r2r_hf.testing.agreement import agreement, teacher_forced

    model, _, _ = pair
    ids = torch.randint(3, 400, (2, 220), generator=torch.Generator().manual_seed(0)).to(DEVICE)
    reads = [12 + 3, 1, 70, 2, 130]  # the prompt's read, a step, a gap longer than the buckets, ...
    eager, captured = _engines(model, 2, ids.shape[1])
    try:
        found = agreement(teacher_forced(eager, ids, 12, reads), teacher_forced(captured, ids, 12, reads))
    finally:
        captured.close()
    assert found["llm"].steps == len(reads) and found["slm"].steps == ids.shape[1] - 12 + 1
    for role in ("slm", "llm"):
        assert found[role].argmax == 1.0 and found[role].max_abs < 1e-3, (role, found[role])


def test_teacher_forced_logits_in_bf16_stay_within_the_stated_tolerance(monkeypatch):
    """bf16 at Qwen2.5-0.5B widths: captured and eager reads differ by rounding only (the bf16 claim of
    docs/fast_path.md)."""
    from r2r_hf.testing.agreement import agreement, teacher_forced
    from transformers import Qwen2Config, Qwen2ForCausalLM

    def qwen(seed, layers):
        torch.manual_seed(seed)
        config = Qwen2Config(hidden_size=896, intermediate_size=4864, num_hidden_layers=layers, num_attention_heads=14,
                             num_key_value_heads=2, vocab_size=4096, max_position_embeddings=1024)
        return Qwen2ForCausalLM(config).to(DEVICE, torch.bfloat16).eval()

    model = R2RForCausalLM.from_models(qwen(0, 2), qwen(1, 2), **SMALL_ROUTER)
    _on_device(model, monkeypatch)
    ids = torch.randint(0, 4096, (2, 104), generator=torch.Generator().manual_seed(1)).to(DEVICE)
    reads = [24, 1, 3, 70, 5]
    eager, captured = _engines(model, 2, ids.shape[1])
    try:
        found = agreement(teacher_forced(eager, ids, 16, reads), teacher_forced(captured, ids, 16, reads))
    finally:
        captured.close()
    for role in ("slm", "llm"):
        assert found[role].max_rel < BF16_REL_TOLERANCE, (role, found[role])


BF16_REL_TOLERANCE = 0.03  # |Δlogit| / max|logit| at the same step; measured in benchmarks/results/gpu_first_run.md
