"""The device check's serving phase: the server's engine in-process (no HTTP) under load, on random-weight shapes.

    python -m benchmarks.gpu.serve --out DIR             # on the GPU (1.5B + 32B shapes, bf16, fused reads)
    python -m benchmarks.gpu.serve --out DIR --dry-run   # the same steps on a CPU: tiny shapes, emulated graphs

The device image has no fastapi/uvicorn, and HTTP is not what is measured: the engine (``r2r_hf/serve/engine.py``, the
decoding thread ``r2r-hf serve`` runs) gets requests directly, ``concurrency`` at a time (closed loop), and the load
reports tokens/s, the inter-token latency (between an answer's tokens as the engine hands them out), the wall time per
step and the time per step outside the graph replays (the host's share, which the server's cost model adds per step:
``benchmarks/serving/cost_model.py``), the capture time, the graph memory and the decoding counters. Routing is forced
per row at a share ``p`` by a router that pays the real router's cost and routes where a hash of the proposal's hidden
state falls below ``p`` (per row, whatever its neighbours; bf16 rounding may move which tokens route, not how many).
Servers, each fresh, in order of value: R2R on fused reads with the GPU's waiting default (what the cost model
predicts), then **the LLM alone on the same engine** (the LLM in the SLM's place, never routing, a 16-wide router: no
SLM, no LLM catch-up, each prompt read once: ``ALONE_OPTIONS``; R2R at threshold 0 would still run the SLM and the
router every step), their ratio at each concurrency, then R2R with ``m = 1``, R2R speculating (depth 4, the server's
default policy for it; random weights roll every resolution back: the worst case) and, as a peer where the image's
transformers has it, HF's own continuous batching of the LLM alone (``generate_batch``, paged attention).
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch

from benchmarks.synthetic import Letters, random_model, request, serving_shape
from r2r_hf import R2RForCausalLM


# Where a served step's time goes: the decoding thread's wall time inside each of these. ``sync`` includes waiting
# for the device (the one read-back); ``propose``, ``read_llm`` and ``commit`` queue the step's kernels and replays.
STAGES = (("r2r_hf.core.batch", "RunningBatch", ("propose", "sync", "read_llm", "commit", "prefill")),
          ("r2r_hf.serve.engine", "Engine", ("_deliver", "_schedule", "_join", "_leave")))


@contextmanager
def stage_clock() -> Iterator[dict[str, float]]:
    """The seconds the decoding thread spends inside each of ``STAGES`` while it lasts (wrapped where defined)."""
    import importlib

    spent: dict[str, float] = {}
    saved = []
    for module, name, methods in STAGES:
        cls = getattr(importlib.import_module(module), name)
        for method in methods:
            owner = next(c for c in cls.__mro__ if method in c.__dict__)
            original = owner.__dict__[method]

            def timed(self, *args, _original=original, _name=method, **kwargs):
                begin = time.perf_counter()
                try:
                    return _original(self, *args, **kwargs)
                finally:
                    spent[_name] = spent.get(_name, 0.0) + time.perf_counter() - begin

            saved.append((owner, method, original))
            setattr(owner, method, timed)
    try:
        yield spent
    finally:
        for owner, method, original in saved:
            setattr(owner, method, original)


def load(engine, model, prompts: list[list[int]], concurrency: int, max_tokens: int, threshold: float,
         timeout: float, replays=None) -> dict:
    """Send ``prompts`` to ``engine``, ``concurrency`` at a time; tokens/s, inter-token latency, time per step (and
    outside the graph replays, when ``replays`` times them: ``timed_replays``), counters."""
    from r2r_hf.model.row_settings import resolve_row

    gate, done, lock = threading.Semaphore(concurrency), threading.Event(), threading.Lock()
    gaps: list[float] = []
    left = [len(prompts)]
    tokens = [0]

    def sink():
        last = [None]

        def emit(event):
            now = time.perf_counter()
            if event[0] == "text":
                if last[0] is not None:
                    with lock:
                        gaps.append(now - last[0])
                last[0] = now
            if event[0] in ("end", "error"):
                with lock:
                    tokens[0] += event[3] if event[0] == "end" else 0
                    left[0] -= 1
                    if not left[0]:
                        done.set()
                gate.release()
        return emit

    before = dict(engine.counters.summary())
    if replays is not None:
        replays.take()
    with stage_clock() as spent:
        start = time.perf_counter()
        for prompt in prompts:
            gate.acquire()
            settings = resolve_row(model, prompt, max_new_tokens=max_tokens, do_sample=False, threshold=threshold)
            engine.submit(request(prompt, settings, sink()))
        if not done.wait(timeout):
            raise TimeoutError(f"the load did not finish in {timeout:.0f} s")
        wall = time.perf_counter() - start
    gaps.sort()
    summary = engine.counters.summary()
    steps = summary["steps"] - before["steps"]
    out = {"concurrency": concurrency, "requests": len(prompts), "tokens": tokens[0], "wall_s": wall,
           "tokens_per_s": tokens[0] / wall, "steps": steps, "ms_per_step": 1e3 * wall / max(steps, 1),
           "itl_p50_ms": 1000 * statistics.median(gaps) if gaps else None,
           "itl_p95_ms": 1000 * gaps[min(len(gaps) - 1, int(0.95 * len(gaps)))] if gaps else None,
           "llm_token_rate": (summary["llm_tokens"] - before["llm_tokens"]) / max(tokens[0], 1),
           "counters_total": summary,
           "host_stages_ms_per_step": {k: 1e3 * v / max(steps, 1) for k, v in sorted(spent.items())}}
    if replays is not None:  # the rest of a step's time: the host's work, and the device idling for it
        out["outside_graphs_ms_per_step"] = 1e3 * (wall - replays.take()) / max(steps, 1)
    return out


def timed_replays(graph_step: type) -> type:
    """``graph_step`` (a ``GraphStep`` class) whose replays add up their device time, read by ``take()`` (and reset):
    CUDA events around each replay on a GPU (no sync: read after the load), the wall clock in the CPU's emulation."""
    class Timed(graph_step):
        marks: list = []
        seconds = [0.0]

        def replay(self) -> None:
            if hasattr(self, "graph"):  # a CUDA graph
                begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                begin.record()
                super().replay()
                end.record()
                Timed.marks.append((begin, end))
                return
            begin = time.perf_counter()
            super().replay()
            Timed.seconds[0] += time.perf_counter() - begin

        @classmethod
        def take(cls) -> float:
            if cls.marks:
                torch.cuda.synchronize()
                cls.seconds[0] += sum(b.elapsed_time(e) for b, e in cls.marks) / 1e3
                cls.marks.clear()
            spent, cls.seconds[0] = cls.seconds[0], 0.0
            return spent

    return Timed


# The LLM alone's server settings: it never routes, and it reads each joining prompt whole at the join (no chunks),
# with the model in the SLM's place only. Chunked prefill reads a prompt with both models (R2R's LLM reads it ahead of
# its first catch-up), which here read every prompt twice: a 32B forward per join that no LLM server pays. The same
# tokens in the same forwards where a prompt fits one chunk (the served loads' prompts do); a longer one is read in
# one turn rather than spread over several, which an LLM server's throughput does not feel.
ALONE_OPTIONS = dict(llm_min_rows=(1,), llm_max_wait=0, prefill_chunk=None)


def llm_alone(model: R2RForCausalLM) -> R2RForCausalLM:
    """The LLM alone on the same engine, served with ``ALONE_OPTIONS``: the LLM in the SLM's place, never routing
    (threshold inf), a 16-wide router (one small captured graph per step): no SLM forward, no LLM catch-up, each prompt
    read once. Its LLM-side slots are captured at start-up (the engine captures both models' reads) and never read."""
    alone = R2RForCausalLM.from_models(model.llm, model.llm, router_hidden_dims=[16]).eval()
    store = model.capture_store
    alone.capture_store = type(store)(graph_step=store.graph_step, graph_devices=store.graph_devices, fuse=store.fuse,
                                      router_dtype=store.router_dtype)
    # Answers run to their max_tokens, as ``serving_shape``'s do (it has set the LLM's own config already).
    alone.generation_config.eos_token_id, alone.generation_config.pad_token_id = None, 0
    return alone


def serve(name: str, model, settings, tokenizer, concurrencies, prompt_tokens, max_tokens, threshold, put,
          deadline: float, generator) -> dict:
    """One fresh server at every concurrency; its numbers through ``put(name, ...)`` as they come."""
    from r2r_hf.serve.engine import Engine

    store, base = model.capture_store, model.capture_store.graph_step
    store.graph_step = replays = timed_replays(base)  # the engine's capturer takes the class at its start
    started = time.perf_counter()
    try:
        engine = Engine(model, tokenizer, settings)
    finally:
        store.graph_step = base
    result = {"start_s": time.perf_counter() - started, "capture": engine.capture_report, "runs": []}
    engine.start()
    try:
        for c in concurrencies:
            prompts = [torch.randint(100, model.shared_vocab_size - 100, (prompt_tokens,), generator=generator).tolist()
                       for _ in range(max(2 * c, 4))]
            result["runs"].append(load(engine, model, prompts, c, max_tokens, threshold,
                                       timeout=max(deadline - time.monotonic(), 5), replays=replays))
            put(name, result)
    finally:
        engine.stop(0)  # nothing is in flight after a finished load; after a failure, end at once
        del engine
        gc.collect()  # its slots and graphs go before the next server captures its own
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    return result


def serving_phase(model, share: float, concurrencies: tuple[int, ...], max_tokens: int, prompt_tokens: int, put,
                  deadline: float, fused: bool = True, peer: bool = True) -> None:
    """Every server of the module docstring at every concurrency; ``put(name, value)`` records each result, and
    ``put("ratios", ...)`` R2R's tokens/s over the LLM alone's at each concurrency."""
    from r2r_hf.core.policy import default_policy
    from r2r_hf.serve.settings import ServeSettings

    generator = torch.Generator().manual_seed(0)
    slots = max(concurrencies)
    wait = default_policy("cuda", slots)
    m1 = dict(llm_min_rows=(1,), llm_max_wait=0)
    servers = [("R2R, waiting", lambda: model, dict(llm_min_rows=wait.min_rows, llm_max_wait=wait.max_wait), 1 - share),
               ("LLM alone", lambda: llm_alone(model), ALONE_OPTIONS, float("inf")),
               ("R2R, m = 1", lambda: model, m1, 1 - share),
               # speculative routing's server default at depth 4; random weights disagree at every routed position,
               # so every resolution rolls back: the worst case's cost (the real pair's agreement is ~88 %)
               ("R2R, speculative (worst case)", lambda: model, dict(speculate=4), 1 - share)]
    found = {}
    for name, which, options, threshold in servers:
        if time.monotonic() > deadline:
            put(name, {"skipped": "the phase's deadline passed"})
            continue
        settings = ServeSettings(max_batch_size=slots, max_queue=1024, batch_wait_ms=0, capture="auto",
                                 unfused_graphs=not fused, max_context=prompt_tokens + max_tokens + 8, **options)
        found[name] = serve(name, which(), settings, Letters(), concurrencies, prompt_tokens, max_tokens, threshold,
                            put, deadline, generator)
        if name == "LLM alone" and "R2R, waiting" in found:  # the ratio the prediction is about (serving/cost_model.py)
            r2r = {r["concurrency"]: r["tokens_per_s"] for r in found["R2R, waiting"]["runs"]}
            put("ratios", {str(r["concurrency"]): r2r[r["concurrency"]] / r["tokens_per_s"]
                           for r in found[name]["runs"] if r["concurrency"] in r2r})
    if peer and hasattr(model.llm, "generate_batch") and time.monotonic() < deadline:  # HF's continuous batching
        put("hf generate_batch, LLM alone", hf_continuous_batching(model.llm, concurrencies, max_tokens, prompt_tokens,
                                                                  model.shared_vocab_size, deadline))


def hf_continuous_batching(llm, concurrencies, max_tokens: int, prompt_tokens: int, vocab: int, deadline: float):
    """Tokens/s of ``llm.generate_batch`` (transformers' continuous batching, paged attention) at each concurrency."""
    from transformers import GenerationConfig

    out = []
    for c in concurrencies:
        if time.monotonic() > deadline:
            out.append({"concurrency": c, "skipped": "the phase's deadline passed"})
            continue
        prompts = [torch.randint(100, vocab - 100, (prompt_tokens,)).tolist() for _ in range(max(2 * c, 4))]
        config = GenerationConfig(max_new_tokens=max_tokens, do_sample=False, eos_token_id=-1, max_batch_tokens=c * 64)
        start = time.perf_counter()
        try:
            # (in inference mode its loop thread failed on every request: transformers 5.17 on the H200)
            with torch.inference_mode(False), torch.no_grad():
                results = llm.generate_batch(prompts, generation_config=config, progress_bar=False)
        except Exception as err:  # noqa: BLE001 - a private-ish API: record why it did not run
            out.append({"concurrency": c, "error": f"{type(err).__name__}: {err}"[:300]})
            continue
        wall = time.perf_counter() - start
        tokens = sum(len(r.generated_tokens) for r in results.values())
        row = {"concurrency": c, "tokens_per_s": tokens / wall, "wall_s": wall, "tokens": tokens}
        if not tokens and results:  # (the first H200 run: 0 tokens in 0.7 s, no error raised): what it returned
            first = next(iter(results.values()))
            row["returned"] = {k: str(getattr(first, k, None))[:200] for k in ("status", "error", "generated_tokens")}
        out.append(row)
    return out


def build(dry_run: bool, device: str, dtype: torch.dtype) -> R2RForCausalLM:
    slm_name, llm_name = ("tiny", "tiny-llm") if dry_run else ("qwen2.5-1.5b", "qwen2.5-32b")
    slm, llm = random_model(slm_name, dtype, device, seed=0), random_model(llm_name, dtype, device, seed=1)
    return R2RForCausalLM.from_models(slm, llm, router_hidden_dims=[1024] * 6 if not dry_run else [32, 32]).eval()


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=".")
    parser.add_argument("--dry-run", action="store_true", help="tiny shapes on this CPU, emulated graphs")
    parser.add_argument("--share", type=float, default=0.1)
    parser.add_argument("--budget-s", type=float, default=150.0)
    parser.add_argument("--no-peer", action="store_true", help="leave out HF's generate_batch")
    parser.add_argument("--unfused-graphs", action="store_true", help="graphs of HF's forward (the dry run's)")
    args = parser.parse_args(argv)
    device = "cpu" if args.dry_run else "cuda"
    dtype = torch.float32 if args.dry_run else torch.bfloat16
    model = build(args.dry_run, device, dtype)
    if args.dry_run:
        from r2r_hf.testing.graphs import emulated_store

        model.capture_store = emulated_store()
    out: dict = {"share": args.share, "device": device, "servers": {}}
    path = Path(args.out) / "gpu_serve.json"

    def put(name, value):
        out["servers"][name] = value
        path.write_text(json.dumps(out, indent=1, default=str))

    with serving_shape(model), torch.inference_mode():
        serving_phase(model, args.share, (2, 4) if args.dry_run else (8, 16),
                      4 if args.dry_run else 128, 16 if args.dry_run else 64, put, time.monotonic() + args.budget_s,
                      fused=not (args.dry_run or args.unfused_graphs), peer=not args.no_peer)
    return out


if __name__ == "__main__":
    main()
