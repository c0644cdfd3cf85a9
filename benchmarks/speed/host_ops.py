"""Host work per decoding step, counted (issue 40): syncing host-to-device copies, device-to-host reads and eager
ops outside the captured graphs, for ``generate`` at batch 1 and the server's engine at 8 and 16 rows.

    python -m benchmarks.speed.host_ops        # writes benchmarks/results/host_ops.json

On this CPU, tiny random Qwen2 models (the counts outside the graphs do not depend on the models' size), CUDA
graphs emulated (``r2r_hf.testing.graphs``: each replay counts once, nothing inside it counts), graphs of HF's
forward (fused reads change what is inside the graphs, not the host loop around them). What each count means on a
GPU and how a CPU run decides it: ``benchmarks/speed/host_count.py``.

* ``generate``, batch 1, static cache: per step = (counts of a call of ``2n`` tokens less those of ``n``) / n, so
  the prefill and the call's set-up cancel out; every step the SLM's (never routes), or every step the LLM's
  (routes every token); a share p costs about (1 - p) x the first + p x the second.
* the server's engine, in-process, driven turn by turn on this thread (the modes are per thread): ``rows`` answers
  join, are prefilled, decode a few steps, then ``steps`` steps are counted (every row decoding, nobody joins or
  leaves); routing forced per row at p = 0.1 by ``benchmarks.synthetic.HashRouter`` under the GPU's waiting default,
  or never, or always.

Host time per step, in a second pass without the modes: the wall time less the emulated replays' (the host's own
Python and eager ops on this CPU; a GPU host differs, and there each syncing copy also waits for the stream). Of
it, ``decide_ms`` runs between the step's read-back and its device work (``RunningBatch.sync`` returning to
``read_llm`` starting: the stop rule and the plan): a GPU idles that long per step however far ahead the rest of
the loop runs (the rest overlaps the device's work where the host queues it faster than the device runs it).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import time
from collections.abc import Iterator
from pathlib import Path

import torch

from benchmarks.record import hardware, versions
from benchmarks.speed.host_count import Counter, counting_steps
from benchmarks.synthetic import HashRouter, Letters, random_model, request, serving_shape
from r2r_hf import R2RForCausalLM
from r2r_hf.testing.graphs import emulated_store

PROMPT = 16
ROUTINGS = {"never": float("inf"), "p = 0.1": 0.9, "always": 0.0}  # the threshold over HashRouter's scores


def pair(counter: Counter | None = None, fuse: bool | str = False) -> R2RForCausalLM:
    """The tiny pair on emulated graphs whose replays pause ``counter`` (and add up their time); ``fuse="plain"``: the
    GPU's path (fused regions, run plain here: the LLM's reads packed, the router folded into the SLM's reads)."""
    slm, llm = random_model("tiny", torch.float32, "cpu", 0), random_model("tiny-llm", torch.float32, "cpu", 1)
    model = R2RForCausalLM.from_models(slm, llm, router_hidden_dims=[64, 64]).eval()
    model.capture_store = emulated_store(counting_steps(counter), fuse=fuse)
    return model


def generate_per_step(model, counter: Counter, tokens: int, threshold: float) -> tuple[dict, float]:
    """Counts per step of ``generate`` at batch 1 (a call of ``2 tokens`` less one of ``tokens``), and the host ms
    per step without the modes."""
    prompt = torch.randint(3, 1000, (1, PROMPT), generator=torch.Generator().manual_seed(0))
    steps = model.capture_store.graph_step

    def call(n: int) -> None:
        model.generate(prompt, max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0,
                       cache_implementation="static", threshold=threshold)

    call(2 * tokens)  # captures every shape (the longer call's state serves the shorter one)
    found = []
    for n in (tokens, 2 * tokens):
        counter.counts = type(counter.counts)()
        with counter:
            call(n)
        found.append(counter.counts)
    short, long = found
    diff = type(short)(**{k: getattr(long, k) - getattr(short, k) for k in ("h2d", "h2d_async", "d2h", "eager",
                                                                            "aten", "replays")},
                       sites=long.sites - short.sites, ops=long.ops - short.ops)
    host_ms = 1e3 * (host_seconds(call, 2 * tokens, steps) - host_seconds(call, tokens, steps)) / tokens
    with deciding() as gaps:
        call(2 * tokens)
    return {**diff.per(tokens), "decide_ms": 2e3 * sum(gaps) / len(gaps)}, host_ms


@contextlib.contextmanager
def deciding() -> Iterator[list[float]]:
    """Collects, per step, minus the time its read-back returned and plus the time its device work started (see
    the module docstring): the sum over a stretch is the host's deciding time, two entries per step."""
    from r2r_hf.core.batch import RunningBatch

    found, sync, read_llm = [], RunningBatch.sync, RunningBatch.read_llm

    def timed_sync(self, *args, **kwargs):
        out = sync(self, *args, **kwargs)
        found.append(-time.perf_counter())
        return out

    def timed_read_llm(self, *args, **kwargs):
        found.append(time.perf_counter())
        return read_llm(self, *args, **kwargs)

    RunningBatch.sync, RunningBatch.read_llm = timed_sync, timed_read_llm
    try:
        yield found
    finally:
        RunningBatch.sync, RunningBatch.read_llm = sync, read_llm


def host_seconds(run, arg, steps, repeats: int = 3) -> float:
    """The best of ``repeats`` runs' wall time less their emulated replays' (``steps``: a ``counting_steps`` class)."""
    best = float("inf")
    for _ in range(repeats):
        steps.seconds, start = 0.0, time.perf_counter()
        run(arg)
        best = min(best, time.perf_counter() - start - steps.seconds)
    return best


def engine_for(model, rows: int, tokens: int, block: int = 1):
    """A captured engine of ``rows`` slots (the GPU's waiting default), not started: the caller drives its turns."""
    from r2r_hf.core.policy import default_policy
    from r2r_hf.serve.engine import Engine
    from r2r_hf.serve.settings import ServeSettings

    wait = default_policy("cuda", rows)
    settings = ServeSettings(max_batch_size=rows, max_queue=1024, batch_wait_ms=0, capture="auto",
                             max_context=PROMPT + tokens + 8, llm_min_rows=wait.min_rows, llm_max_wait=wait.max_wait,
                             draft_block=block)
    return Engine(model, Letters(), settings)


def served_per_step(model, counter: Counter, rows: int, threshold: float, steps: int,
                    block: int = 1) -> tuple[dict, float]:
    """Counts per served step at ``rows`` rows (``steps`` counted after a warm-up), and the host ms per step."""
    from r2r_hf.model.row_settings import resolve_row

    # the joining turn, the warm-up, five stretches of ``steps`` turns (counted, timed 3 times, deciding): a block's
    # steps each at most
    warm = 6
    tokens = (1 + warm + 5 * steps) * block + 12
    engine = engine_for(model, rows, tokens, block)
    generator = torch.Generator().manual_seed(rows)
    for _ in range(rows):
        prompt = torch.randint(100, 900, (PROMPT,), generator=generator).tolist()
        settings = resolve_row(model, prompt, max_new_tokens=tokens, do_sample=False, threshold=threshold)
        engine.submit(request(prompt, settings, lambda event: None))

    def turns(n: int) -> None:
        for _ in range(n):
            if not engine.queue and not engine.batch.ledger.occupied():  # (the engine would wait for a request)
                raise RuntimeError("every answer ended before the turns did: give the answers more tokens")
            engine._turn(engine._schedule())

    turns(1)  # every row joins and its prompt is read (one chunk: PROMPT < prefill_chunk)
    turns(warm)  # the router's first check, the first LLM catch-ups
    if engine.batch.ledger.prefilling() or len(engine.batch.ledger.occupied()) != rows:
        raise RuntimeError("the rows are not all decoding after the warm-up")
    counter.counts = type(counter.counts)()
    before = engine.counters.steps
    with counter:
        turns(steps)
    counted = engine.counters.steps - before  # (``steps`` turns, or more steps where turns draft blocks)
    host_ms = 1e3 * host_seconds(turns, steps, model.capture_store.graph_step) / counted
    with deciding() as gaps:
        turns(steps)
    if counted < steps or (block == 1 and counted != steps) or len(engine.batch.ledger.occupied()) != rows:
        raise RuntimeError(f"{counted} steps in {steps} turns, {len(engine.batch.ledger.occupied())} rows left")
    return {**counter.counts.per(counted), "decide_ms": 2e3 * sum(gaps) / max(len(gaps), 1)}, host_ms


def measure(rows: tuple[int, ...] = (8, 16), tokens: int = 16, steps: int = 12,
            routings: dict[str, float] = ROUTINGS, fused: bool = False) -> dict:
    """Every count of the module docstring: ``generate`` at batch 1, never and always routing; the engine at each of
    ``rows`` under each routing; with ``fused``, the engine again on the GPU's path (``fused``: the LLM's reads
    packed, the router folded into the SLM's reads), one step per synchronisation and in blocks of 4."""
    torch.manual_seed(0)
    counter = Counter()
    model = pair(counter)
    out: dict = {"generate_1": {}, "server": {}}
    with torch.inference_mode():
        for name, threshold in (("slm step (never routes)", float("inf")), ("llm step (every token routed)", 0.0)):
            counts, host_ms = generate_per_step(model, counter, tokens, threshold)
            out["generate_1"][name] = {**counts, "host_ms": host_ms}
        with serving_shape(model):
            assert isinstance(model.router, HashRouter)
            for k in rows:
                for name, threshold in routings.items():
                    counts, host_ms = served_per_step(model, counter, k, threshold, steps)
                    out["server"][f"{k} rows, {name}"] = {**counts, "host_ms": host_ms}
    if fused:
        out["server_fused"] = served_fused(rows, steps, routings)
    return out


def served_fused(rows: tuple[int, ...], steps: int, routings: dict[str, float]) -> dict:
    """The engine on the fused path's shapes (``pair(fuse="plain")``), blocks of 1 and 4 (``fast/drafts.py``)."""
    counter = Counter()
    model, out = pair(counter, fuse="plain"), {}
    with torch.inference_mode(), serving_shape(model):
        for k in rows:
            for name, threshold in routings.items():
                for block in (1, 4):
                    counts, host_ms = served_per_step(model, counter, k, threshold, steps, block)
                    out[f"{k} rows, {name}, blocks of {block}"] = {**counts, "host_ms": host_ms}
    return out


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="benchmarks/results/host_ops.json")
    parser.add_argument("--steps", type=int, default=16, help="served steps counted per case")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    found = measure(steps=args.steps, fused=True)
    result = {"conditions": {**versions(), "cpu": hardware(), "threads": 1, "dtype": "float32",
                             "models": "tiny + tiny-llm (benchmarks/speed/parts.py)",
                             "graphs": "emulated: HF's forward (server), fused regions run plain (server_fused)",
                             "prompt": PROMPT},
              **found}
    Path(args.out).write_text(json.dumps(result, indent=1))
    for section in ("generate_1", "server", "server_fused"):
        for name, c in found[section].items():
            print(f"{section:10s} {name:32s} h2d {c['h2d_syncing']:5.1f}  d2h {c['d2h_reads']:4.1f}  "
                  f"eager {c['eager_ops']:6.1f}  aten {c['aten_ops']:6.1f}  replays {c['graph_replays']:4.1f}  "
                  f"host {c['host_ms']:.2f} ms (deciding {c['decide_ms']:.2f})")
    return result


if __name__ == "__main__":
    main()
