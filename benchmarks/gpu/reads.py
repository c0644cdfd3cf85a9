"""Every read a served load replays, by shape and kind: the serving phases' per-read histogram.

The first device run gave only totals per served step, so the step's budget had to be inferred. While a ``ReadLog``
is attached, each slot read of the server (``PaddedSteps.read``: the proposing model's padded reads;
``PackedSteps.read``: the LLM's packed reads) labels the graph replays it runs with its role, its kind (``prefill``
while rows join or read their prompt, ``resolution`` inside a speculative resolution, ``step`` for the proposing
model's one-token reads, ``catch-up`` for the LLM's other reads), its rows, its tokens (real, and the bucket it
replays at) and the columns it attends, and so does the router's graph over the proposals (``CapturedRouter``);
``serve.timed_replays`` times each replay (CUDA events; the wall clock in the CPU's emulation) under the label of the
read that runs it. ``histogram`` adds them up per label. A speculative
resolution's own wall time (its host work and its read-back) is kept per call too.
"""

from __future__ import annotations

import contextlib
import statistics
import time
from collections.abc import Iterator

import torch

ACTIVE: ReadLog | None = None  # the log the replays report to (one load at a time)


class ReadLog:
    """The labelled replays of one load (see the module docstring)."""

    def __init__(self) -> None:
        self.label: tuple | None = None
        self.kind: list[str] = []  # the enclosing kinds (prefill, resolution)
        self.marks: list[tuple[tuple, object, object]] = []  # (label, begin event, end event) on a GPU
        self.seconds: list[tuple[tuple, float]] = []  # (label, seconds) in the CPU's emulation
        self.resolutions: list[float] = []  # each resolution's wall seconds

    def note(self, begin, end=None) -> None:
        """A replay under the current read's label: CUDA events, or (``end`` None) the seconds it took."""
        label = self.label or ("unlabelled", "", 0, 0, 0, 0)
        if end is None:
            self.seconds.append((label, begin))
        else:
            self.marks.append((label, begin, end))

    def histogram(self) -> list[dict]:
        """Per label: the replays, their total and mean milliseconds, largest first."""
        if self.marks:
            torch.cuda.synchronize()
        timed = [(label, b.elapsed_time(e)) for label, b, e in self.marks] + [(l, 1e3 * s) for l, s in self.seconds]
        groups: dict[tuple, list[float]] = {}
        for label, ms in timed:
            groups.setdefault(label, []).append(ms)
        names = ("role", "kind", "rows", "tokens", "bucket", "span")
        out = [{**dict(zip(names, label)), "reads": len(ms), "ms_total": sum(ms), "ms_mean": sum(ms) / len(ms),
                "ms_p50": statistics.median(ms)} for label, ms in groups.items()]
        return sorted(out, key=lambda row: -row["ms_total"])

    def resolution_summary(self) -> dict | None:
        """A resolving step's wall time in ``resolve`` (its host work, the LLM's read and the read-back) against the
        device time of its reads: what the host adds per resolving step."""
        if not self.resolutions:
            return None
        device = sum(row["ms_total"] for row in self.histogram() if row["kind"] == "resolution")
        wall = 1e3 * sum(self.resolutions)
        n = len(self.resolutions)
        return {"resolutions": n, "wall_ms_mean": wall / n, "device_ms_mean": device / n,
                "host_ms_mean": (wall - device) / n}

    @contextlib.contextmanager
    def attached(self) -> Iterator[ReadLog]:
        """Label the server's reads while it lasts (the methods are wrapped where they are defined)."""
        global ACTIVE
        from r2r_hf.core import batch
        from r2r_hf.core.fast.packed_reads import PackedSteps
        from r2r_hf.core.fast.slot_reads import PaddedSteps, CapturedRouter

        saved = [(PaddedSteps, "read", PaddedSteps.read), (PackedSteps, "read", PackedSteps.read),
                 (CapturedRouter, "_scores", CapturedRouter._scores),
                 (batch.RunningBatch, "join", batch.RunningBatch.join),
                 (batch.RunningBatch, "prefill", batch.RunningBatch.prefill), (batch, "resolve", batch.resolve)]
        PaddedSteps.read, PackedSteps.read = self._padded(PaddedSteps.read), self._packed(PackedSteps.read)
        CapturedRouter._scores = self._router(CapturedRouter._scores)
        batch.RunningBatch.join = self._inside("prefill", batch.RunningBatch.join)
        batch.RunningBatch.prefill = self._inside("prefill", batch.RunningBatch.prefill)
        batch.resolve = self._timed_resolve(batch.resolve)
        ACTIVE = self
        try:
            yield self
        finally:
            ACTIVE = None
            for owner, name, original in saved:
                setattr(owner, name, original)

    def _labelled(self, label: tuple, run):
        before, self.label = self.label, label
        try:
            return run()
        finally:
            self.label = before

    def _padded(self, read):
        from r2r_hf.core.fast.fused import attended
        from r2r_hf.core.fast.static_reads import bucket_for

        def wrapped(reads, tokens, rows, starts, counts, every=False):
            kind = self.kind[-1] if self.kind else ("step" if reads.hidden else "catch-up")
            span = attended(max(s + n for s, n in zip(starts, counts)), reads.cache.capacity)
            label = ("slm" if reads.hidden else "llm", kind, len(rows), sum(counts), bucket_for(max(counts)), span)
            return self._labelled(label, lambda: read(reads, tokens, rows, starts, counts, every))

        return wrapped

    def _packed(self, read):
        from r2r_hf.core.fast.fused import attended

        def wrapped(reads, tokens, plan):
            kind = self.kind[-1] if self.kind else "catch-up"
            span = attended(max(s + n for s, n in zip(plan.starts, plan.counts)), reads.cache.capacity)
            label = ("llm", kind, len(plan.rows), plan.real, plan.width, span)
            return self._labelled(label, lambda: read(reads, tokens, plan))

        return wrapped

    def _router(self, scores):
        def wrapped(router, logits, hidden, token):
            k = next(b for b in router.rows if b >= len(token))
            label = ("router", self.kind[-1] if self.kind else "step", len(token), 0, k, 0)
            return self._labelled(label, lambda: scores(router, logits, hidden, token))

        return wrapped

    def _inside(self, kind: str, method):
        def wrapped(*args, **kwargs):
            self.kind.append(kind)
            try:
                return method(*args, **kwargs)
            finally:
                self.kind.pop()

        return wrapped

    def _timed_resolve(self, resolve):
        inside = self._inside("resolution", resolve)

        def wrapped(*args, **kwargs):
            start = time.perf_counter()
            try:
                return inside(*args, **kwargs)
            finally:
                self.resolutions.append(time.perf_counter() - start)

        return wrapped
