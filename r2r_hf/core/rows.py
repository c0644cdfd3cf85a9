"""The host side of a running batch: a ``RowState`` per slot and the step counter (``BatchRows``).

Planning (``plan.py``) reads these values and the step updates them after its device work: which rows wait for the
LLM, what each row's speculative tail holds (``Pending``), how much of each answer is confirmed, which tokens have
reached the host and which have been handed on. ``RunningBatch`` (``batch.py``) adds the device side; the cost
model's replay (``benchmarks/replay.py``) adds costs. Nothing here touches a tensor.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from .plan import Settlement, StepPlan

@dataclass
class Pending:
    """A routed position its row went past with the SLM's token (speculative routing: ``speculation.py``).

    Args:
        index: the token's index in the row's answer.
        step: the step it was routed (and committed) at.
        before, after: the row's random stream before and after the SLM's draw there (None: greedy).
    """

    index: int
    step: int
    before: Any = None
    after: Any = None


@dataclass
class RowState:
    """One row's host-side state between steps.

    Args:
        owner: what the row answers (the server's answer; None in ``generate``).
        max_new: tokens the row may still commit (the length limit's one home; it drains after the last).
        waiting_since: the step it was routed at while it waits for the LLM (None: not waiting).
        rng: its random stream before the SLM draw that routed it (the LLM draws from there).
        by_llm: whether the token it committed last counts as the LLM's (its value reaches the host next step).
        draining: it committed its last token; it proposes no more and leaves once the host has read it.
        prefilling: its prompt is still being read (a piece per turn: ``RunningBatch.prefill``).
        written: answer tokens committed, a speculative tail included.
        confirmed: of those, the ones no rollback can take back (all of them without speculation).
        pending: the routed positions of its speculative tail, oldest first.
        tail: (step committed, counts as the LLM's) of each token past ``confirmed``.
        arrived: (token, counts as the LLM's) of each answer token that reached the host and was not delivered.
        delivered: answer tokens handed to the caller (``Synced.delivered``): confirmed ones only.
    """

    owner: Any = None
    max_new: int = 2**62
    waiting_since: int | None = None
    rng: Any = None
    by_llm: bool = False
    draining: bool = False
    prefilling: bool = False
    written: int = 0
    confirmed: int = 0
    pending: list[Pending] = field(default_factory=list)
    tail: list[tuple[int, bool]] = field(default_factory=list)
    arrived: list[tuple[int, bool]] = field(default_factory=list)
    delivered: int = 0

    def last_index(self, index: int) -> bool:
        """Whether answer token ``index`` is the last the length limit allows."""
        return index == self.written + self.max_new - 1



class BatchRows:
    """The host side of a running batch (see the module docstring). Its subclass provides ``counters``.

    Args:
        slots: rows at most.
        cuts_together: the rows share one length (HF's rectangle): a rollback cuts every row back, and a token is
            confirmed once every row's is.
    """

    def __init__(self, slots: int, cuts_together: bool = False) -> None:
        self.rows: list[RowState | None] = [None] * slots
        self.step_no = 0
        self.cuts_together = cuts_together

    def occupied(self) -> list[int]:
        return [r for r, row in enumerate(self.rows) if row is not None]

    def proposing(self) -> list[int]:
        """Rows that propose this step: in the batch, prompt read, not waiting for the LLM, not draining."""
        return [r for r, row in enumerate(self.rows) if row is not None and row.waiting_since is None
                and not row.draining and not row.prefilling]

    def decoding(self) -> bool:
        """Whether a step has anything to do (a row proposes, waits for the LLM or has a token to hand over)."""
        return any(row is not None and not row.prefilling for row in self.rows)

    def prefilling(self) -> list[int]:
        return [r for r, row in enumerate(self.rows) if row is not None and row.prefilling]

    def waiting(self) -> list[int]:
        return [r for r, row in enumerate(self.rows) if row is not None and row.waiting_since is not None]

    def free_slots(self) -> int:
        return sum(row is None for row in self.rows)

    def speculating(self) -> bool:
        """Whether some row holds a speculative tail."""
        return any(row is not None and row.pending for row in self.rows)

    def arrive(self, previous: list[int]) -> list[list[tuple[int, bool, bool]]]:
        """The tokens committed at the previous step reach the host (``previous``: one per slot, -1: none); each
        row's confirmed tokens not yet handed on, as (token, counts as the LLM's, last the length limit allows)."""
        out: list[list[tuple[int, bool, bool]]] = []
        for r, row in enumerate(self.rows):
            if row is None:
                out.append([])
                continue
            if previous[r] >= 0:
                row.arrived.append((previous[r], row.by_llm))
            n = min(len(row.arrived), row.confirmed - row.delivered)
            out.append([(token, by_llm, row.last_index(row.delivered + i))
                        for i, (token, by_llm) in enumerate(row.arrived[:n])])
            row.arrived, row.delivered = row.arrived[n:], row.delivered + n
            self.counters.delivered(n, sum(by_llm for _, by_llm, _ in out[-1]))
        return out

    def start_waiting(self, plan: StepPlan, states: Mapping[int, Any]) -> None:
        """Rows the LLM writes for from now on (routed in this step, not going on speculatively) wait from where
        their stream stood before the SLM's draw."""
        for r in plan.routed:
            if r not in plan.ended and r not in plan.speculating:
                self.rows[r].waiting_since, self.rows[r].rng = plan.step, states.get(r)

    def advance(self, plan: StepPlan, settled: Settlement | None = None,
                states: Mapping[int, tuple[Any, Any]] | None = None) -> None:
        """After the step ran: rows cut back where the LLM rejected a speculative token (``settled``), the LLM's rows
        stop waiting, every writer has one token more (a speculating row's is pending, with its stream's states
        before and after the SLM's draw from ``states``), and what is confirmed moves on."""
        settled = settled or Settlement.plain(plan)
        kept = {r: self.rows[r].tail[settled.rollbacks[r] - self.rows[r].confirmed][1] for r in settled.kept}
        for r, index in settled.rollbacks.items():
            self._cut(r, index)
        llm = set(settled.llm_writers)
        for r in llm | set(plan.llm_writers):  # (where a rollback cut a waiting row back, its wait is over too)
            self.rows[r].waiting_since = self.rows[r].rng = None
        for r in settled.writers:
            row = self.rows[r]
            row.by_llm = kept[r] if r in kept else r in llm or r in plan.speculating
            if r in plan.speculating:
                before, after = (states or {}).get(r, (None, None))
                row.pending.append(Pending(row.written, plan.step, before, after))
            row.tail.append((plan.step, row.by_llm))
            row.written += 1
            row.max_new -= 1
            row.draining = row.max_new <= 0
        for r in settled.resolved:  # every pending position the LLM read is settled: confirmed, or cut away
            self.rows[r].pending = []
        self._confirm()
        self.step_no += 1

    def _cut(self, r: int, index: int) -> None:
        """Row ``r`` back to its first ``index`` answer tokens (those past it are thrown away)."""
        row = self.rows[r]
        row.pending = [p for p in row.pending if p.index < index]
        row.max_new += row.written - index
        row.tail = row.tail[: index - row.confirmed]
        row.arrived = row.arrived[: max(index - row.delivered, 0)]
        row.written, row.draining = index, False

    def _confirm(self) -> None:
        """Tokens before a row's first pending position are confirmed (in a rectangle, before every row's)."""
        live = [row for row in self.rows if row is not None]
        frontier = {id(row): row.pending[0].index if row.pending else row.written for row in live}
        if self.cuts_together and live:
            common = min(frontier.values())
            frontier = dict.fromkeys(frontier, common)
        for row in live:
            new = frontier[id(row)]
            if new > row.confirmed:
                row.tail = row.tail[new - row.confirmed:]
                row.confirmed = new
