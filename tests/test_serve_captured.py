"""The server on the captured path (issue 31): static slots, every step captured per rows and tokens bucket.

On this CPU the captures are the emulated CUDA graphs of ``r2r_hf.testing.graphs`` (a replay overwrites the
outputs of the others sharing its pool, a host synchronisation inside a step fails, a replay that takes another
path than its capture fails), and ``torch.compile`` where marked. Answers must equal ``generate`` alone (fp32)
with rows joining and leaving, greedy and seeded, under m = 1, waiting and speculating; joins copy no cache.
"""

import concurrent.futures

import httpx
import openai
import pytest
import torch

from r2r_hf.testing.graphs import emulated_store
from serving import gap_threshold, generated, serving

PROMPTS = ["the old man said that he was", "water", "write a new line", "the first time you see", "def print",
           "he was a good man and"]


def _serve_and_compare(model, tok, slots: int = 4, at_start=None, **settings):
    tau = gap_threshold(model, tok, PROMPTS, 0.5, 0.9)
    jobs = [(PROMPTS[i], 6 + 2 * i, i % 2 == 1, 7 + i) for i in range(len(PROMPTS))]
    with serving(model, tok, max_batch_size=slots, **settings) as (url, service):
        if at_start is not None:  # called once the server listens, before any request
            at_start(url, service)
        client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=300)

        def ask(job):
            prompt, n, sampled, seed = job
            out = client.completions.create(model="tiny", prompt=prompt, max_tokens=n, temperature=1.0 if sampled else 0,
                                            seed=seed, extra_body={"threshold": tau})
            return out.choices[0].text, out.model_extra["r2r"]["llm_tokens"]

        with concurrent.futures.ThreadPoolExecutor(len(jobs)) as pool:  # 6 requests, fewer slots: joins and leaves
            got = list(pool.map(ask, jobs))
        report, counters = service.engine.capture_report, service.engine.counters
    for (prompt, n, sampled, seed), answer in zip(jobs, got):
        options = {"do_sample": sampled, "threshold": tau, **({"temperature": 1.0, "seed": seed} if sampled else {})}
        assert answer == generated(model, tok, prompt, n, **options), prompt
    assert sum(llm for _, llm in got) > 0, "the LLM wrote some tokens"
    assert counters.join_bytes == 0, "static slots: no join copies a cache"
    return report, counters


@pytest.mark.parametrize("policy", [{"llm_min_rows": (1,), "llm_max_wait": 0}, {"llm_min_rows": (2,), "llm_max_wait": 4},
                                    {"llm_min_rows": (3,), "llm_max_wait": 8, "speculate": 4}],
                         ids=["m1", "m2-w4", "speculating"])
def test_served_answers_on_emulated_graphs_equal_generate_alone(model, tok, monkeypatch, policy):
    monkeypatch.setattr(model, "capture_store", emulated_store())
    report, counters = _serve_and_compare(model, tok, max_context=96, **policy)
    assert report["path"] == "graphs" and report["columns"] == 97
    gathering = 2 * 7  # the LLM's reads that gather their rows: rows buckets 1 and 2 (below the largest) x tokens
    resolving = 3 * 7 + gathering if policy.get("speculate") else 0  # the LLM's reads keeping every position's logits
    assert not policy.get("speculate") or counters.agreed + counters.rejected > 0, "it speculated"
    assert report["steps"] == 2 * 3 * 7 + gathering + 3 + resolving, \
        "the SLM and LLM reads per rows (1, 2, 4) x tokens bucket, the LLM's gathering ones, the router (and the " \
        "resolving reads)"


def test_served_answers_on_fused_emulated_graphs_equal_generate_alone(model, tok, monkeypatch):
    # Fused reads (issue 32: one inductor region per decoder layer, captured whole) over 2 slots.
    monkeypatch.setattr(model, "capture_store", emulated_store(fuse=True))
    report, _ = _serve_and_compare(model, tok, slots=2, max_context=64, llm_min_rows=(2,), llm_max_wait=4)
    assert report["path"] == "graphs" and report["fused"] == {"slm": True, "llm": True}


def test_unfused_graphs_replay_hfs_forward(model, tok, monkeypatch):
    monkeypatch.setattr(model, "capture_store", emulated_store(fuse=True))
    with serving(model, tok, max_batch_size=1, max_context=24, unfused_graphs=True) as (_, service):
        assert service.engine.capture_report["fused"] == {"slm": False, "llm": False}


@pytest.mark.compile
def test_served_answers_through_torch_compile_equal_generate_alone(model, tok, monkeypatch):
    """Every step is compiled at start-up and none after (issue 41, item 6: they compiled at first use, on the
    decoding thread while every answer waited, and past dynamo's 8 recompiles of the one read code object later
    shapes ran uncompiled while /health said "compile").

    Compiled by dynamo and AOTAutograd (``aot_eager``): the graphs, guards, recompiles and functionalised cache
    writes of the server's compile path, without inductor's kernels, whose numerics on these very reads
    tests/test_capture.py and test_invariants.py check through generate. Inductor compiling all 37 shapes cold
    took over 5 minutes here; aot_eager about 40 s."""
    from torch._dynamo.utils import counters as dynamo
    from transformers import CompileConfig

    from r2r_hf.serve import capture

    monkeypatch.setattr(capture, "CompileConfig", lambda **kw: CompileConfig(**{**kw, "backend": "aot_eager",
                                                                                "mode": None}))
    # 2 slots: the joins and leaves of 6 requests through 2 slots, and 2-row steps.
    started, before = {}, dynamo["stats"]["unique_graphs"]

    def at_start(url, service):
        started["health"] = httpx.get(url + "/health", timeout=30).json()
        started["graphs"] = dynamo["stats"]["unique_graphs"]

    report, _ = _serve_and_compare(model, tok, slots=2, capture="compile", max_context=64, at_start=at_start)
    # the SLM and LLM reads per rows (1, 2) x tokens bucket, the LLM's gathering reads of one row, the router per
    # rows bucket
    steps = 2 * 2 * 7 + 1 * 7 + 2
    assert report["path"] == "compile" and report["steps"] == steps
    assert {k: started["health"][k] for k in ("path", "steps")} == {"path": "compile", "steps": steps}
    assert started["health"]["seconds"] > 0
    assert started["graphs"] - before >= steps, "some steps were left uncompiled at start-up"
    assert dynamo["stats"]["unique_graphs"] == started["graphs"], "a step was compiled while serving"


def test_a_request_longer_than_the_static_slots_is_refused(model, tok, monkeypatch):
    monkeypatch.setattr(model, "capture_store", emulated_store())
    with serving(model, tok, max_batch_size=2, max_context=40) as (url, _):
        body = {"model": "tiny", "prompt": "water " * 10, "max_tokens": 20}  # 31 prompt tokens
        reply = httpx.post(url + "/v1/completions", json=body, timeout=60)
        ok = httpx.post(url + "/v1/completions", json={**body, "max_tokens": 5}, timeout=60)
    assert reply.status_code == 400 and reply.json()["error"]["code"] == "context_length_exceeded"
    assert ok.status_code == 200


def test_where_nothing_captures_the_server_says_why_and_graphs_refuses_to_start(model, tok, caplog):
    with caplog.at_level("WARNING"), serving(model, tok, max_batch_size=2) as (_, service):
        assert service.engine.capture_report["path"] == "eager"
        assert "run on cpu" in service.engine.capture_report["why"]
    assert any("run eagerly" in r.getMessage() for r in caplog.records)
    with pytest.raises(ValueError, match=r"capture=.graphs. \(--capture graphs\) cannot capture"):
        with serving(model, tok, capture="graphs"):
            pass


def test_buckets_are_captured_largest_first(model, tok, monkeypatch):
    # The smaller graphs then reuse the blocks the larger ones left in the pool (vLLM captures in that order too).
    from r2r_hf.serve.engine import Engine
    from r2r_hf.serve.settings import ServeSettings
    from r2r_hf.testing.graphs import EmulatedGraphStep

    shapes = []

    class Recording(EmulatedGraphStep):
        def __init__(self, fn, example, pool):
            shapes.append(tuple(example["ids"].shape) if "ids" in example else ("router", len(example["token"])))
            super().__init__(fn, example, pool)

    monkeypatch.setattr(model, "capture_store", emulated_store(Recording))
    Engine(model, tok, ServeSettings(max_batch_size=4, max_context=24))
    reads, routers = [s for s in shapes if s[0] != "router"], [s[1] for s in shapes if s[0] == "router"]
    slm = 3 * 7  # the SLM's reads (rows 4, 2, 1 x tokens), then the LLM's (and its gathering ones of rows 2 and 1)
    assert len(reads) == slm + 3 * 7 + 2 * 7
    for model_reads in (reads[:slm], reads[slm:]):
        assert model_reads == sorted(model_reads, reverse=True) and model_reads[0] == (4, 64), model_reads
    assert routers == [4, 2, 1]


def test_reads_attend_the_columns_filled_rounded_up_to_powers_of_two(model, tok, monkeypatch):
    # Issue 40, item 3: every captured read attended the slots' whole capacity (4096 columns by default). Now a read
    # attends the columns its rows fill, rounded up to a power of two >= 256, as generate's reads do: here a long
    # answer crosses 256 columns beside a short one, both answer as generate alone, and both spans were read.
    from r2r_hf.core.fast import slot_reads

    monkeypatch.setattr(model, "capture_store", emulated_store())
    spans, serving_now = [], []

    def attended(filled, capacity):
        span = real(filled, capacity)
        if serving_now:
            spans.append(span)
        return span

    real = slot_reads.attended
    monkeypatch.setattr(slot_reads, "attended", attended)
    tau = gap_threshold(model, tok, PROMPTS, 0.5, 0.9)
    jobs = [("the old man said that he was a good man and " * 12, 24), ("water", 24)]
    with serving(model, tok, max_batch_size=2, max_context=300) as (url, service):
        assert service.engine.capture_report["steps"] == 2 * 2 * 7 * 2 + 1 * 7 * 2 + 2, \
            "reads per rows x tokens x span (256, 301), the LLM's gathering reads of one row, the router"
        serving_now.append(True)
        client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=300)
        def ask(job):
            reply = client.completions.create(model="tiny", prompt=job[0], max_tokens=job[1], temperature=0,
                                              extra_body={"threshold": tau})
            return reply.choices[0].text

        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            got = list(pool.map(ask, jobs))
    for (prompt, n), answer in zip(jobs, got):
        assert answer == generated(model, tok, prompt, n, do_sample=False, threshold=tau)[0]
    assert {256, 301} <= set(spans), spans


@pytest.mark.parametrize("fuse", [False, True], ids=["hf-forward", "fused"])
@pytest.mark.parametrize("slots,rows,bucket", [(4, [3], 1), (8, [7, 2, 5], 4)], ids=["alone", "with-a-filler"])
def test_a_catch_up_of_high_slots_replays_the_small_graph_and_reads_as_eager(model, fuse, slots, rows, bucket):
    """The first H200 run: a captured read of slots 3 and 12 of 16 replayed the 16-row graph, so at 16 users the
    LLM's catch-ups read 16 rows x the longest lag and R2R served 0.90x the LLM alone. The LLM's reads gather their
    rows instead where that makes a smaller bucket (a slot it does not read fills the bucket, writing nothing): the
    logits, in the rows' order, and what the read writes into the cache are an eager read's; other slots keep
    theirs."""
    from r2r_hf.core.abilities import abilities
    from r2r_hf.core.fast.fused_reads import regions_for
    from r2r_hf.core.fast.slot_reads import PaddedSteps
    from r2r_hf.core.layouts.slot_cache import SlotCache, read_piece
    from r2r_hf.testing.graphs import EmulatedGraphStep

    llm, layers = model.llm, model.llm.config.num_hidden_layers
    tokens = torch.randint(3, 400, (slots, 48), generator=torch.Generator().manual_seed(0))
    filled = [20, 9, 14, 30, 11, 25, 7, 30][:slots]
    eager, static = SlotCache(layers, slots, 47), SlotCache(layers, slots, 47)
    with torch.inference_mode():
        for cache in (eager, static):
            read_piece(llm, cache, tokens, list(range(slots)), [0] * slots, filled)
        pool = EmulatedGraphStep.new_pool(torch.device("cpu"))
        reads = PaddedSteps(llm, static, lambda fn, example: EmulatedGraphStep(fn, example, pool), hidden=False,
                              regions=regions_for(llm, fuse, abilities(llm).fuse), gather=True)
        before = [kv.clone() for kv in (*static.keys, *static.values)]
        starts, counts = [filled[r] for r in rows], [5, 3, 1][: len(rows)]
        got = reads.read(tokens, rows, starts, counts)[0]
        want, _ = read_piece(llm, eager, tokens, rows, starts, counts)
    assert list(reads.steps) == [(bucket, 8, 47, False, True)], "one gathering read of the rows' own bucket"
    assert reads.fused == fuse
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    for k_eager, k_static, k_before in zip((*eager.keys, *eager.values), (*static.keys, *static.values), before):
        for r in range(slots):
            if r in rows:
                torch.testing.assert_close(k_static[r, :, :47], k_eager[r, :, :47], rtol=1e-4, atol=1e-4)
            else:
                assert torch.equal(k_static[r, :, :47], k_before[r, :, :47]), f"slot {r} was written"


@pytest.mark.parametrize("policy", [{"llm_min_rows": (1,), "llm_max_wait": 0}, {"llm_min_rows": (2,), "llm_max_wait": 4},
                                    {"llm_min_rows": (3,), "llm_max_wait": 8, "speculate": 4}],
                         ids=["m1", "m2-w4", "speculating"])
def test_served_answers_through_packed_llm_reads_equal_generate_alone(model, tok, monkeypatch, policy):
    """The LLM's packed reads (``layouts/packed.py``: one flat forward per catch-up, resolution or prompt piece, each
    token attending its own slot, logits only where needed), its fused regions run plain (no compile), captured on
    emulated graphs."""
    monkeypatch.setattr(model, "capture_store", emulated_store(fuse="plain"))
    report, counters = _serve_and_compare(model, tok, max_context=96, **policy)
    assert report["packed"] and report["fused"] == {"slm": True, "llm": True}
    assert not policy.get("speculate") or counters.agreed + counters.rejected > 0, "it speculated"
    assert counters.llm_rows_real <= counters.llm_rows_read < 2 * counters.llm_rows_real + 8 * counters.llm_forwards


def _gathering_reads(model, capture, reads: int, strict: bool = False) -> tuple:
    """``reads`` captured reads by the LLM of slot 1 alone of 2 (a gathering read: 1 row, not the 2-row graph), with
    ``strict`` the ones after the first failing where dynamo would compile again; the cache and what one read
    gathers: every layer's keys and values of 1 row x the span it attends."""
    import torch._dynamo.config as dynamo_config

    from r2r_hf.core.fast.slot_reads import PaddedSteps
    from r2r_hf.core.layouts.slot_cache import SlotCache, read_piece

    llm, config = model.llm, model.llm.config
    tokens = torch.randint(3, 400, (2, 40), generator=torch.Generator().manual_seed(0))
    cache = SlotCache(config.num_hidden_layers, 2, 39)
    with torch.inference_mode():
        read_piece(llm, cache, tokens, [0, 1], [0, 0], [9, 12])
        cache.gathered_bytes = 0
        captured = PaddedSteps(llm, cache, capture, hidden=False, gather=True)
        for i in range(reads):
            with dynamo_config.patch(error_on_recompile=strict and i > 0):
                captured.read(tokens, [1], [12 + i], [1])
    assert [key[4] for key in captured.steps] == [True], "one gathering read"
    dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return cache, 2 * config.num_hidden_layers * config.num_key_value_heads * 39 * dim * 4


@pytest.mark.compile
def test_a_compiled_read_runs_again_without_compiling_again():
    """Issue 52, item 5: ``--capture compile`` hit dynamo's recompile limit while serving, on some runs. The cause:
    a gathering read added its bytes to a Python counter of the slot cache inside the compiled read, so dynamo
    guarded on the counter's value, and the next gathering read (whenever the rows the LLM read happened to be a
    subset of the slots: timing) compiled again, past the limit (the startup's compiles hold the one code object's
    entries), and ran uncompiled. Here the second read fails where it would compile again."""
    from transformers import CompileConfig

    from r2r_hf.serve.capture import compile_now
    from r2r_hf.testing import make_tiny_llm, make_tiny_slm
    from r2r_hf import R2RForCausalLM

    model = R2RForCausalLM.from_models(make_tiny_slm(), make_tiny_llm(), router_hidden_dims=[8], router_expansion=1)
    # (a limit past what other tests' reads of the same code object compiled in this process)
    compiled = compile_now(CompileConfig(fullgraph=False, dynamic=False, backend="aot_eager"), 256)
    cache, each = _gathering_reads(model, compiled, 3, strict=True)
    assert cache.gathered_bytes == 3 * each


def test_gathered_bytes_count_every_replay(model):
    """Issue 52, item 6: under captured graphs ``gathered_bytes`` read 0 whatever happened (the Python counter ran at
    capture only, as a CUDA graph's replay runs no Python; the emulation now keeps a replay from changing the numbers
    of the objects a step closes over, as a real one does). Counted on the host from the read's shapes."""
    from r2r_hf.testing.graphs import EmulatedGraphStep

    pool = EmulatedGraphStep.new_pool(torch.device("cpu"))
    cache, each = _gathering_reads(model, lambda fn, example: EmulatedGraphStep(fn, example, pool), 3)
    assert cache.gathered_bytes == 3 * each


def test_served_answers_with_draft_blocks_equal_generate_alone(model, tok, monkeypatch):
    """Draft blocks (``fast/drafts.py``: 4 steps per host synchronisation while every running answer is greedy) on
    emulated graphs, fused regions run plain: answers equal ``generate`` alone, greedy and seeded alike."""
    monkeypatch.setattr(model, "capture_store", emulated_store(fuse="plain"))
    report, counters = _serve_and_compare(model, tok, max_context=96, llm_min_rows=(3,), llm_max_wait=8, speculate=4,
                                          draft_block=4)
    assert report["packed"] and report["folded"] and report["block"] == 4
    assert counters.host_syncs < counters.steps + counters.resolutions, "some steps were drafted in blocks"
