"""The step's decisions as a plain value: ``plan_step`` decides, over host values only, what one step does.

A step of the running batch (``turn.py``) proposes on the device, reads what the host needs in one
synchronisation, then *plans* here — which rows write a token (the SLM's, or the LLM's), which wait for the LLM,
whether the LLM runs and which rows it reads, which rows the SLM reads next — and only then executes the plan
on the device (``step.py``). Planning knows nothing of models, tensors or devices: the same function decides
``generate``'s steps, the server's and the cost model's replay of recorded routing
(``benchmarks/serve_model.py``), and a ``StepPlan`` can be printed, compared and replayed.

``BatchRows`` is the host side of a running batch that planning reads and updates: one ``RowState`` per slot and
the step counter. ``RunningBatch`` (``batch.py``) adds the device side; the cost model's replay adds costs.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from .policy import WaitPolicy


@dataclass
class RowState:
    """One row's host-side state between steps.

    Args:
        owner: what the row answers (the server's answer; None in ``generate``).
        max_new: tokens the row may still commit (the length limit's one home; it drains after the last).
        waiting_since: the step it was routed at while it waits for the LLM (None: not waiting).
        rng: its random stream before the SLM draw that routed it (the LLM draws from there).
        by_llm: whether the token it committed last came from the LLM (its value reaches the host next step).
        draining: it committed its last token; it proposes no more and leaves once the host has read it.
        prefilling: its prompt is still being read (a piece per turn: ``RunningBatch.prefill``).
    """

    owner: Any = None
    max_new: int = 2**62
    waiting_since: int | None = None
    rng: Any = None
    by_llm: bool = False
    draining: bool = False
    prefilling: bool = False


@dataclass(frozen=True)
class StepPlan:
    """What one step does (rows are slot numbers, in slot order).

    Args:
        step: the step's number.
        proposed: rows that proposed a token; routed: those whose proposal the router sent to the LLM.
        ended: rows whose answer ended before this step (their previous token ended it, or their draw failed):
            they commit nothing and leave.
        slm_writers: rows that commit the SLM's proposal; llm_writers: rows the LLM writes a token for (empty:
            the LLM does not run).
        llm_reads: rows the LLM reads its unread tokens of (the writers; every row in a rectangle).
        waiting: rows that wait for the LLM after this step.
        slm_reads: rows the SLM reads the committed token of (writers that will propose again).
        waited: steps each LLM writer waited (0: routed in this step).
    """

    step: int
    proposed: tuple[int, ...] = ()
    routed: tuple[int, ...] = ()
    ended: tuple[int, ...] = ()
    slm_writers: tuple[int, ...] = ()
    llm_writers: tuple[int, ...] = ()
    llm_reads: tuple[int, ...] = ()
    waiting: tuple[int, ...] = ()
    slm_reads: tuple[int, ...] = ()
    waited: tuple[int, ...] = ()

    @property
    def writers(self) -> tuple[int, ...]:
        """Rows that commit a token this step."""
        return tuple(sorted(self.slm_writers + self.llm_writers))


def plan_step(rows: Sequence[RowState | None], step: int, proposed: Sequence[int], routed: Sequence[bool],
              ended: set[int], policy: WaitPolicy, reads_every_row: bool = False) -> StepPlan:
    """Decide one step from host values (see the module docstring).

    Args:
        rows: each slot's state before the step (None: free).
        step: the step's number.
        proposed: rows that proposed; routed: the router's decision for each of them.
        ended: rows whose answer ended before this step.
        policy: when the LLM runs.
        reads_every_row: the layout's LLM reads every row whenever it runs (HF's rectangle).
    """
    occupied = [r for r, row in enumerate(rows) if row is not None and r not in ended]
    slm_writers = tuple(r for r, hit in zip(proposed, routed) if not hit and r not in ended)
    since = {r: rows[r].waiting_since for r in occupied if rows[r].waiting_since is not None}
    since.update({r: step for r, hit in zip(proposed, routed) if hit and r not in ended})
    waiting = sorted(since)
    oldest = max((step - since[r] for r in waiting), default=0)
    runs = policy.runs(len(waiting), len(occupied), oldest, stalled=not slm_writers)
    llm_writers = tuple(waiting) if runs else ()
    writers = sorted(slm_writers + llm_writers)
    return StepPlan(
        step=step, proposed=tuple(proposed), routed=tuple(r for r, hit in zip(proposed, routed) if hit),
        ended=tuple(sorted(ended)), slm_writers=slm_writers, llm_writers=llm_writers,
        llm_reads=tuple(occupied) if runs and reads_every_row else llm_writers,
        waiting=tuple(r for r in waiting if not runs), slm_reads=tuple(r for r in writers if rows[r].max_new > 1),
        waited=tuple(step - since[r] for r in llm_writers))


class BatchRows:
    """The host side of a running batch: a ``RowState`` per slot (None: free) and the step counter."""

    def __init__(self, slots: int) -> None:
        self.rows: list[RowState | None] = [None] * slots
        self.step_no = 0

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

    def start_waiting(self, plan: StepPlan, states: Mapping[int, Any]) -> None:
        """Rows routed in this step wait for the LLM from where their stream stood before the SLM's draw."""
        for r in plan.routed:
            if r not in plan.ended:
                self.rows[r].waiting_since, self.rows[r].rng = plan.step, states.get(r)

    def advance(self, plan: StepPlan) -> None:
        """After the plan ran: the LLM's rows stop waiting, every writer has one token more."""
        for r in plan.llm_writers:
            self.rows[r].waiting_since = self.rows[r].rng = None
        llm = set(plan.llm_writers)
        for r in plan.writers:
            row = self.rows[r]
            row.by_llm = r in llm
            row.max_new -= 1
            row.draining = row.max_new <= 0
        self.step_no += 1
