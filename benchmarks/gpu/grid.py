"""The cost grid of the device check: what each kind of forward costs, from the engine's own captured steps.

The cost model (``benchmarks/serving/cost_model.py``) prices a served step by its forwards. The first device run
timed few of them (the LLM's padded reads at 1 and 8 rows; nothing fused past one token at 8 or 16 rows), so the
prediction rested on extrapolations. Here batches of slots are built as the server builds its own
(``RunningBatch.for_slots``, ``fast/slot_reads.capture_slots`` with the store's capturer: CUDA graphs on a GPU, the
emulation on a CPU), of the servers' own shapes: the short answers' server (slots for the largest concurrency, as
many columns as its answers need), and the long answers' (``plan.long_users`` slots). A fused region compiles per
cache shape, so the grid's reads compile exactly what the servers' start-ups then reuse, and what it times is what
they replay (at the spans they attend). Each point is one captured step, replayed ``replays`` times under CUDA events
(the wall clock on a CPU):

* ``llm_padded``: the LLM's fused slot read of k rows x g tokens with its hidden state (``PaddedSteps``, as the
  LLM alone's server reads: the LLM in the SLM's place);
* ``llm_packed``: the LLM's packed read at each total-token bucket T (``PackedSteps``: min(T, slots) rows sharing
  T tokens, one kept logit per slot, as a catch-up keeps them);
* ``llm_verify``: packed reads of k rows x g tokens keeping the logits at every position (a resolution's worst);
* ``llm_long`` (on the long answers' batch): the padded and the packed LLM read and the SLM's read of every slot x 1
  token attending ``long_span`` columns;
* ``slm``: the SLM's slot read (with its hidden state, and the router folded into it on the read's argmax proposals
  where the server folds it: ``fast/router_copy.folded``; ``grid_slots.folded`` says which) of k rows x g tokens;
* ``router``: the router as its own captured graph over k proposals (the server's where it cannot fold it), and
  ``topk``: the top-k of the SLM's logits alone, captured (the router's cost grew ~46 us per row on the first run: a
  suspect is top-k over the vocabulary).

Each point is captured once (``warm_grid``, untimed: fused regions compile there) and timed in the grid phase. The
host's own time per served step is measured apart (``host_per_step``): decoding steps of the same batch that never
route, less the SLM's and the router's replays.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from r2r_hf.core.abilities import abilities
from r2r_hf.core.batch import Joiner, RunningBatch
from r2r_hf.core.choice import RowRule
from r2r_hf.core.fast.fused import attended
from r2r_hf.core.fast.fused_reads import regions_for
from r2r_hf.core.fast.graphs import gc_paused
from r2r_hf.core.fast.packed_reads import PackedSteps
from r2r_hf.core.fast.slot_reads import PaddedSteps, capture_slots
from r2r_hf.core.layouts.packed import inputs as packed_inputs, pack, tokens_buckets
from r2r_hf.core.layouts.slot_cache import piece_inputs
from r2r_hf.core.policy import WaitPolicy
from r2r_hf.core.turn import decode_step


@dataclass(frozen=True)
class Point:
    """One grid point: its section and key in the JSON, its shape, and one call of its captured step."""

    section: str
    key: str
    shape: dict
    call: Callable[[], object]


class Slots:
    """One batch of slots and the captured reads over it: the SLM's and the LLM's packed ones as the server captures
    them (``capture_slots``), and the LLM's padded reads with its hidden state."""

    def __init__(self, model, slots: int, columns: int, device: torch.device, capture, router_dtype: str) -> None:
        self.batch = RunningBatch.for_slots(model.routed_pair().for_call(), slots, columns, device)
        self.layout = layout = self.batch.layout
        with torch.inference_mode(), gc_paused(collect=True):
            self.report = capture_slots(layout, capture, warm=False, fuse=True, router_dtype=router_dtype)
        regions = regions_for(model.llm, True, abilities(model.llm).fuse)
        self.padded = PaddedSteps(model.llm, layout.llm_cache, capture, hidden=True, regions=regions)


class Grid:
    """The grid's batches (see the module docstring); ``points`` lists every grid point of ``plan``."""

    def __init__(self, model, plan) -> None:
        store, device = model.capture_store, torch.device(plan.device)
        self.model, self.plan, self.device = model, plan, device
        step, pool = store.graph_step, store.graph_step.new_pool(device)
        self.capture = lambda fn, example: step(fn, example, pool)  # noqa: E731 - the server's (serve/capture.py)
        short, long = server_columns(plan)
        self.short = Slots(model, max(plan.serve), short, device, self.capture, store.router_dtype)
        self.long = Slots(model, plan.long_users, long, device, self.capture, store.router_dtype)
        if plan.long_span >= long or plan.grid_context + plan.grid_tokens[-1] >= short:
            raise ValueError(f"the grid's points do not fit its slots ({short} and {long} columns)")
        self.batch, self.layout, self.report = self.short.batch, self.short.layout, self.short.report
        self.topk_steps: dict = {}  # the top-k alone, captured per rows (the reads' steps live on their readers)

    def points(self) -> list[Point]:
        """Every point of the plan's grid, in the module docstring's order."""
        p, slots, short, long = self.plan, max(self.plan.serve), self.short, self.long
        out = [self._padded("llm_padded", short, short.padded, k, g, p.grid_context)
               for k in p.grid_rows for g in p.grid_tokens]
        for total in tokens_buckets(slots * p.grid_tokens[-1]):
            rows = min(total, slots)
            counts = [total // rows + (i < total % rows) for i in range(rows)]
            out.append(self._packed("llm_packed", str(total), short, counts, p.grid_context, every=False))
        out += [self._packed("llm_verify", f"{k}x{g}", short, [g] * k, p.grid_context, every=True)
                for k in p.verify_rows for g in p.verify_tokens]
        at, k = p.long_span - 1, p.long_users  # the read's token sits at the last column of the span
        out += [self._padded("llm_long", long, long.padded, k, 1, at, key=f"llm padded {k}x1"),
                self._packed("llm_long", f"llm packed {k}x1", long, [1] * k, at, every=False),
                self._padded("llm_long", long, long.layout.path.slm.steps, k, 1, at, key=f"slm {k}x1")]
        slm = short.layout.path.slm.steps
        out += [self._padded("slm", short, slm, k, g, p.grid_context) for k in p.slm_rows for g in p.slm_tokens]
        out += [self._router(k) for k in p.slm_rows] + [self._topk(k) for k in p.slm_rows]
        return out

    def _padded(self, section: str, slots: Slots, reads: PaddedSteps, k: int, g: int, start: int,
                key: str | None = None) -> Point:
        example = piece_inputs(slots.layout.tokens, list(range(k)), [start] * k, [g] * k, g, reads.cache.trash)
        span = attended(start + g, reads.cache.capacity)
        return Point(section, key or f"{k}x{g}", {"rows": k, "tokens": g, "span": span},
                     lambda: reads.step(k, g, span, example)(**example))

    def _packed(self, section: str, key: str, slots: Slots, counts: list[int], start: int, every: bool) -> Point:
        reads, rows, tokens = slots.layout.path.llm.steps, list(range(len(counts))), slots.layout.tokens
        if not isinstance(reads, PackedSteps):  # (the LLM could not be fused: its reads are HF's forward, padded)
            return Point(section, key, {"rows": len(rows), "tokens": sum(counts)}, _unpacked)
        wanted = [(r, start + n - 1) for r, n in zip(rows, counts)] if not every else [
            (r, start + j) for r, n in zip(rows, counts) for j in range(n)]
        kept = len(wanted) if every else reads.cache.slots  # (a catch-up keeps one per slot, as the server's)
        plan = pack(rows, [start] * len(rows), counts, wanted, kept)
        example = packed_inputs(plan, tokens, reads.cache.trash)
        example["qpos"] = example["qpos"].view(reads.cache.slots, plan.group)
        span = attended(start + max(counts), reads.cache.capacity)
        shape = {"rows": len(rows), "tokens": sum(counts), "width": plan.width, "group": plan.group, "span": span,
                 "kept": kept}
        return Point(section, key, shape, lambda: reads.step(plan.width, plan.group, span, kept, example)(**example))

    def _router(self, k: int) -> Point:
        router, (logits, hidden, token) = self.layout.path.route, self._proposals(k)
        inputs = {"logits": logits, "hidden": hidden, "token": token}

        def call():
            if k not in router.steps:
                router._scores(logits, hidden, token)  # captured per rows bucket, as the server's
            return router.steps[k](**inputs)

        return Point("router", str(k), {"rows": k}, call)

    def _topk(self, k: int) -> Point:
        logits, topk, steps = self._proposals(k)[0], self.model.config.num_topk_logits, self.topk_steps

        def call():
            if k not in steps:
                steps[k] = self.capture(lambda logits: (torch.topk(logits, topk).values,), {"logits": logits})
            return steps[k](logits=logits)

        return Point("topk", str(k), {"rows": k, "vocab": logits.shape[-1], "k": topk}, call)

    def _proposals(self, k: int):
        slm = self.model.slm
        head = slm.get_output_embeddings().weight
        generator = torch.Generator(self.device).manual_seed(k)
        logits = torch.randn(k, head.shape[0], device=self.device, dtype=head.dtype, generator=generator)
        hidden = torch.randn(k, slm.config.hidden_size, device=self.device, dtype=head.dtype, generator=generator)
        return logits, hidden, logits.argmax(-1)

    def close(self) -> None:
        self.short.batch.close()
        self.long.batch.close()


def server_columns(plan) -> tuple[int, int]:
    """The columns of the short and the long answers' servers (``served.py``): what their answers need, plus one
    (``serve/capture.capture_plan``)."""
    return plan.prompt + plan.serve_tokens + 9, plan.prompt + plan.long_tokens + 9


def _unpacked():
    raise RuntimeError("the LLM's reads are not packed here (it could not be fused: see fused_check, fallbacks)")


def replay_ms(call: Callable[[], object], device: torch.device, replays: int) -> list[float]:
    """Milliseconds of each of ``replays`` calls after one untimed call: CUDA events around each (read after the
    last, no synchronisation between them), the wall clock on a CPU."""
    call()
    if device.type != "cuda":
        out = []
        for _ in range(replays):
            start = time.perf_counter()
            call()
            out.append(1e3 * (time.perf_counter() - start))
        return out
    marks = []
    for _ in range(replays):
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        call()
        end.record()
        marks.append((begin, end))
    torch.cuda.synchronize()
    return [b.elapsed_time(e) for b, e in marks]


def summary(times: list[float]) -> dict:
    return {"ms": statistics.median(times), "min_ms": min(times), "max_ms": max(times), "replays": len(times)}


def host_per_step(grid: Grid, rows: int, steps: int, costs: dict) -> dict:
    """The host's time per decoding step of ``rows`` rows in the grid's batch: ``steps`` steps that never route
    (the SLM's read and the router each step, no LLM), wall time less the grid's own replays of those two (``costs``:
    the grid's sections; the router's none where it is folded into the SLM's read)."""
    batch, plan = grid.batch, grid.plan
    prompt = torch.randint(100, 1000, (plan.prompt,), generator=torch.Generator().manual_seed(rows)).tolist()
    rule = RowRule([], None, True)
    joined = batch.join([Joiner(prompt, steps + 4, float("inf"), rule) for _ in range(rows)])
    policy = WaitPolicy()
    try:
        for _ in range(3):  # warm: the first steps' host paths
            decode_step(batch, policy)
        sync = torch.cuda.synchronize if grid.device.type == "cuda" else (lambda: None)
        sync()
        start = time.perf_counter()
        for _ in range(steps):
            decode_step(batch, policy)
        sync()
        wall = 1e3 * (time.perf_counter() - start) / steps
    finally:
        batch.leave(joined)
    router = costs["router"].get(str(rows), {}).get("ms", 0.0)  # (none: the router is folded into the SLM's read)
    device_ms = costs["slm"][f"{rows}x1"]["ms"] + router
    return {"rows": rows, "steps": steps, "wall_ms_per_step": wall, "replays_ms_per_step": device_ms,
            "host_ms_per_step": max(wall - device_ms, 0.0)}

