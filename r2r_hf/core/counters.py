"""What a decoding run did, counted in units that do not depend on the machine.

Every running batch keeps one ``Counters`` (``generate`` returns it, the server exports it on ``/metrics``, the
benchmarks report it): model forwards per generated token say what a GPU would pay in weight reads, rows per
LLM forward say how well routed rows share one, waits say what sharing cost the routed rows, host
synchronisations per step say how often the host stalls the device, and the bytes copied say what joins cost.
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass, field

WAIT_BOUNDS = (0, 1, 2, 4, 8, 16, 32, 64, 128)  # the wait histogram's bucket bounds, in steps (then +Inf)
ACCEPTED_BOUNDS = (0, 1, 2, 3, 4, 6, 8, 12, 16, 32)  # pending positions one resolution confirmed of one row


class Histogram:
    """Whole numbers counted in fixed buckets (``bounds``, then +Inf): by default the steps routed tokens waited for
    the LLM (``WAIT_BOUNDS``).

    A server counts one wait per LLM-written token for as long as it runs: a list of them grew without end and every
    ``/metrics`` scrape scanned it. Here memory and every read are constant: the count per bucket, the sum and the
    largest wait. Quantiles are therefore bucket bounds (exact for 0, 1 and 2 steps, an upper bound above).
    """

    def __init__(self, bounds: tuple[int, ...] = WAIT_BOUNDS) -> None:
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)  # per bucket (not cumulative); the last is +Inf
        self.total = 0  # the sum of the waits
        self.max = 0

    def append(self, steps: int) -> None:
        """Count one routed token that waited ``steps`` steps."""
        self.counts[bisect.bisect_left(self.bounds, steps)] += 1
        self.total += steps
        self.max = max(self.max, steps)

    def extend(self, waits) -> None:
        for steps in waits:
            self.append(steps)

    def __len__(self) -> int:
        return sum(self.counts)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Histogram) and (self.counts, self.total, self.max) == (other.counts, other.total,
                                                                                               other.max)

    def cumulative(self) -> list[tuple[float, int]]:
        """(bound, waits <= bound) per bucket, +Inf last: Prometheus's histogram buckets."""
        counts, out, running = list(self.counts), [], 0  # one copy: the decoding thread may count meanwhile
        for bound, n in zip((*self.bounds, math.inf), counts):
            running += n
            out.append((bound, running))
        return out

    def quantile(self, q: float) -> float | None:
        """The bound of the bucket holding the wait at rank ``q`` (capped at the largest wait), or None when empty."""
        buckets = self.cumulative()
        n = buckets[-1][1]
        if not n:
            return None
        rank = min(n - 1, int(q * n))
        bound = next(b for b, below in buckets if below > rank)
        return float(min(bound, self.max))

    def mean(self) -> float | None:
        n = len(self)
        return self.total / n if n else None


@dataclass
class Counters:
    """Totals of one running batch (every field only grows).

    Args:
        steps: decoding steps (each proposes for every row that is not waiting).
        generated: answer tokens handed to the caller (prompts excluded; with speculation, confirmed ones only).
        llm_tokens: of those, tokens the LLM wrote.
        slm_forwards: SLM forwards (a prefill or catch-up read in several pieces counts each piece).
        llm_forwards: LLM forwards (the same way).
        llm_calls: LLM catch-ups (one per step in which the LLM ran).
        llm_rows: rows the LLM served (wrote a token for, or resolved pending positions of), summed over catch-ups.
        host_syncs: times the host waited for the device.
        waits: for every routed token, the steps its row waited for the LLM (0: the LLM ran at once), in fixed
            buckets (``Histogram``: constant memory however long a server runs).
        joins: rows that joined the batch; join_bytes: KV bytes copied to make room for them.
        gathered_bytes: KV bytes gathered for forwards over a subset of the rows.
        slm_rows_read, llm_rows_read: token-rows each model's forwards computed (padding included: a padded read
            counts rows x width, a packed one its tokens bucket), from the shapes the host chose (so they count
            under captured graphs too); slm_rows_real, llm_rows_real: of those, real tokens.
        router_steps: steps in which the router scored the proposals (it does not run where no proposing row's
            routing depends on it: ``routing.fixed_routing``).
        frontier_tokens: tokens the LLM wrote from a resolving read at the position after a row's tail, which the SLM
            did not propose (``plan.StepPlan.frontier``; a rollback of the tail discards it: not counted).
        resolutions: LLM forwards that resolved speculative (pending) positions (``speculation.py``); agreed: pending
            positions the LLM confirmed; rejected: those it did not; thrown: committed tokens thrown away by rollbacks;
            accepted: per row and resolution, the pending positions confirmed (``ACCEPTED_BOUNDS``); drafted: per row
            and resolution, the pending positions judged (the depth its draft reached: ``plan.depth``).
    """

    steps: int = 0
    generated: int = 0
    llm_tokens: int = 0
    slm_forwards: int = 0
    llm_forwards: int = 0
    llm_calls: int = 0
    llm_rows: int = 0
    host_syncs: int = 0
    waits: Histogram = field(default_factory=Histogram)
    joins: int = 0
    join_bytes: int = 0
    gathered_bytes: int = 0
    slm_rows_read: int = 0
    slm_rows_real: int = 0
    llm_rows_read: int = 0
    llm_rows_real: int = 0
    router_steps: int = 0
    frontier_tokens: int = 0
    resolutions: int = 0
    agreed: int = 0
    rejected: int = 0
    thrown: int = 0
    accepted: Histogram = field(default_factory=lambda: Histogram(ACCEPTED_BOUNDS))
    drafted: Histogram = field(default_factory=lambda: Histogram(ACCEPTED_BOUNDS))
    shapes: list[tuple[str, int, int]] | None = None  # when traced: (model, rows, tokens per row) of each forward

    def forward(self, role: str, rows: int, tokens: int, real: int | None = None, read: int | None = None) -> None:
        """Count one forward of ``role`` ("slm" or "llm") over ``rows`` rows of at most ``tokens`` tokens: ``real``
        tokens in all (default rows x tokens), ``read`` token-rows computed (default rows x tokens)."""
        real = rows * tokens if real is None else real
        read = rows * tokens if read is None else read
        if role == "slm":
            self.slm_forwards += 1
            self.slm_rows_real, self.slm_rows_read = self.slm_rows_real + real, self.slm_rows_read + read
        else:
            self.llm_forwards += 1
            self.llm_rows_real, self.llm_rows_read = self.llm_rows_real + real, self.llm_rows_read + read
        if self.shapes is not None:
            self.shapes.append((role, rows, tokens))

    def step(self, plan, outcome) -> None:
        """Count one step that ran ``plan`` (a ``plan.StepPlan``) and committed ``outcome`` (a ``plan.Outcome``)."""
        self.steps += 1
        served = set(plan.llm_writers) | set(plan.resolving)
        if served:
            self.llm_calls += 1
            self.llm_rows += len(served)
            self.waits.extend(plan.waited)
        if plan.resolving:  # the LLM judged pending positions: confirmed some, rejected some, threw tokens away
            self.frontier_tokens += sum(not waited and r not in plan.proposed and r not in outcome.rollbacks
                                        for r, waited in zip(plan.llm_writers, plan.waited))
            self.resolutions += 1
            self.agreed += outcome.agreed
            self.rejected += outcome.rejected
            self.thrown += outcome.thrown
            self.accepted.extend(agreed for r, (agreed, _, _) in outcome.tally.items() if r in plan.resolving)
            self.drafted.extend(held for held in outcome.held.values() if held)

    def delivered(self, tokens: int, llm_tokens: int) -> None:
        """Answer tokens handed to the caller (confirmed ones only), and how many of them count as the LLM's; an
        answer that ended before some of them gives those back (a speculative tail past its EOS)."""
        self.generated += tokens
        self.llm_tokens += llm_tokens

    def summary(self) -> dict[str, float | int | None]:
        """The ratios the benchmarks and ``/metrics`` report (None where nothing was counted yet); the wait quantiles
        are bucket bounds (``Histogram.quantile``), the mean exact."""
        per_token = (lambda n: n / self.generated) if self.generated else (lambda n: None)  # noqa: E731
        return {
            "steps": self.steps,
            "generated": self.generated,
            "llm_tokens": self.llm_tokens,
            "llm_forwards_per_token": per_token(self.llm_forwards),
            "llm_calls_per_token": per_token(self.llm_calls),
            "slm_forwards_per_token": per_token(self.slm_forwards),
            "rows_per_llm_call": self.llm_rows / self.llm_calls if self.llm_calls else None,
            "wait_steps_p50": self.waits.quantile(0.5),
            "wait_steps_p95": self.waits.quantile(0.95),
            "wait_steps_mean": self.waits.mean(),
            "host_syncs_per_step": self.host_syncs / self.steps if self.steps else None,
            "joins": self.joins,
            "join_bytes_per_join": self.join_bytes / self.joins if self.joins else None,
            "gathered_bytes": self.gathered_bytes,
            "llm_rows_read": self.llm_rows_read,
            "llm_rows_useful": self.llm_rows_real / self.llm_rows_read if self.llm_rows_read else None,
            "slm_rows_useful": self.slm_rows_real / self.slm_rows_read if self.slm_rows_read else None,
            "llm_forwards": self.llm_forwards,
            "slm_forwards": self.slm_forwards,
            "router_steps": self.router_steps,
            "frontier_tokens": self.frontier_tokens,
            "speculative_agreed": self.agreed,
            "speculative_rejected": self.rejected,
            "thrown": self.thrown,
            "pending_resolved_per_llm_call": (self.agreed + self.rejected) / self.resolutions if self.resolutions else None,
            "agreement_at_routed": self.agreed / (self.agreed + self.rejected) if self.agreed + self.rejected else None,
            "thrown_per_token": per_token(self.thrown),
            "mean_depth": self.drafted.mean(),
        }
