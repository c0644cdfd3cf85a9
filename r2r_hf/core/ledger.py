"""The ledger: each row's progress, on the host, and the one function that moves it (``Ledger.apply``).

A running batch *has* a ledger (the engine's, ``generate``'s and the cost model's replay alike). Planning
(``plan.py``) reads it; after the step's device work ``apply`` writes what the step decided — which rows wait for
the LLM, which rows were cut back, who wrote a token, what each row's speculative tail holds, what is now confirmed —
and returns what changed. Between steps, ``arrive`` hands the host the tokens a step committed (one step late,
confirmed ones only). Nothing here touches a tensor.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from .choice import RowRule
from .plan import DRAFT_FIRST, Outcome, StepPlan, adapted


@dataclass
class Pending:
    """A routed position its row went past with the SLM's token (speculative routing: ``speculation.py``).

    Args:
        index: the token's index in the row's answer.
        step: the step it was routed (and committed) at.
        before, after: the row's random stream before and after the SLM's draw there (None: greedy).
        chance: the SLM's probability of its token (``moves.Standing.chance``; 1 where the policy does not read it).
    """

    index: int
    step: int
    before: Any = None
    after: Any = None
    chance: float = 1.0


@dataclass
class Speculated:
    """What speculation did for one answer (its ``usage``, ``generate``'s per-row counts): pending positions the LLM
    resolved (settled: confirmed, or cut away after the one it rejected), confirmed, rejected, committed tokens its
    rollbacks threw away, and its drafts the LLM judged (``resolved / drafts``: the depth its drafts reached)."""

    resolved: int = 0
    agreed: int = 0
    rejected: int = 0
    thrown: int = 0
    drafts: int = 0

    def as_dict(self) -> dict[str, int]:
        return {"pending_resolved": self.resolved, "agreed": self.agreed, "rejected": self.rejected,
                "thrown": self.thrown, "drafts": self.drafts}


class Written(NamedTuple):
    """One committed answer token as the ledger keeps it until it is confirmed (and hands it on then)."""

    index: int  # its index in the row's answer
    step: int  # the step that committed it (a rollback to it restores the budget to after that step)
    by_llm: bool  # it counts as the LLM's
    stream: Any = None  # the row's random stream after it, where the batch keeps streams (``generate``'s draws)


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
        tail: each token past ``confirmed`` (``Written``).
        arrived: (token, counts as the LLM's) of each answer token that reached the host and was not delivered.
        delivered: answer tokens handed to the caller (``Synced.delivered``): confirmed ones only.
        routes: the router's decision is known without it (``routing.fixed_routing``): True, every proposal routes;
            False, none does; None: the router decides.
        ends: tokens that end its answer: a speculative tail the host has seen one in goes no further (what the SLM
            would write past it the LLM most likely never needs: ``plan.plan_step``).
        depth: pending positions it may hold at most (None: the policy's; ``plan.depth``: a request's own switch).
        drafting: its own depth by acceptance (``plan.adapted``, moved at each resolution of its tail; ``plan.depth``
            reads it where it routes everywhere and the policy adapts).
        speculated: what speculation did for it so far (``Speculated``).
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
    tail: list[Written] = field(default_factory=list)
    arrived: list[tuple[int, bool]] = field(default_factory=list)
    delivered: int = 0
    routes: bool | None = None
    ends: frozenset[int] = frozenset()
    depth: int | None = None
    drafting: int = DRAFT_FIRST
    speculated: Speculated = field(default_factory=Speculated)

    def last_index(self, index: int) -> bool:
        """Whether answer token ``index`` is the last the length limit allows."""
        return index == self.written + self.max_new - 1

    def ended_in_tail(self) -> bool:
        """Whether a token of its speculative tail that reached the host ends its answer (once confirmed)."""
        return bool(self.ends and self.pending) and any(token in self.ends for token, _ in self.arrived)


@dataclass
class Joiner:
    """A row asking to join: its prompt and settings (the server's ``RunningBatch.join`` takes a list)."""

    prompt: list[int]
    max_new: int
    threshold: float
    rule: RowRule
    llm_budget: float | None = None
    owner: Any = None
    ends: frozenset[int] = frozenset()  # tokens that end its answer (``RowState.ends``)
    depth: int | None = None  # pending positions it may hold at most (``RowState.depth``; None: the policy's)


@dataclass(frozen=True)
class Applied:
    """What ``Ledger.apply`` changed: the index of the token each writer committed, and the tokens each row has
    newly confirmed (in order; a confirmed token no rollback can take back)."""

    written: dict[int, int]
    confirmed: dict[int, list[Written]]


class Ledger:
    """Every row's progress (see the module docstring).

    Args:
        slots: rows at most.
        lockstep: the rows move together (HF's rectangle): a rollback cuts every row back, and a token is confirmed
            once every row's is.
    """

    def __init__(self, slots: int, lockstep: bool = False) -> None:
        self.rows: list[RowState | None] = [None] * slots
        self.step_no = 0
        self.lockstep = lockstep

    # ------------------------------------------------------------ what the rows are doing
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

    def finished(self) -> bool:
        """Whether every row wrote its last token and none holds a tail a rollback could reopen."""
        return all(row is None or row.draining for row in self.rows) and not self.speculating()

    def stream_before(self, r: int, states: Mapping[int, Any]) -> Any:
        """Where row ``r``'s stream stood before the SLM's draw the LLM writes in place of: where it stood when it
        started waiting, or, routed now, its stream in ``states`` (the proposal's)."""
        row = self.rows[r]
        return row.rng if row.waiting_since is not None else states.get(r)

    def step_of(self, r: int, index: int) -> int:
        """The step that committed row ``r``'s answer token ``index`` (a tail token's)."""
        row = self.rows[r]
        return row.tail[index - row.confirmed].step

    def oldest_tail_step(self, default: int) -> int:
        """The earliest step a rollback can reach back to (``default`` where no row holds a tail)."""
        return min((row.tail[0].step for row in self.rows if row is not None and row.tail), default=default)

    # ------------------------------------------------------------ rows in and out
    def admit(self, slot: int, row: RowState) -> None:
        """``row`` takes free slot ``slot`` (its prompt being read where ``row.prefilling``)."""
        if self.rows[slot] is not None:
            raise ValueError(f"slot {slot} holds a row: a row joins a free slot")
        self.rows[slot] = row

    def ready(self, rows: list[int]) -> None:
        """The prompts of ``rows`` are read: they propose from the next step."""
        for r in rows:
            self.rows[r].prefilling = False

    def release(self, rows: list[int]) -> None:
        """The slots of ``rows`` are free (their answers ended, or their clients went away)."""
        for r in rows:
            self.rows[r] = None

    # ------------------------------------------------------------ what moves them
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
        return out

    def apply(self, plan: StepPlan, outcome: Outcome, before: Mapping[int, Any] = {},  # noqa: B006 (read only)
              after: Mapping[int, Any] = {}, streams: Mapping[int, Any] = {},  # noqa: B006
              chances: Mapping[int, float] = {}) -> Applied:  # noqa: B006
        """The step ran ``plan`` and committed ``outcome``: routed rows not written now wait from where their stream
        stood before the SLM's draw (``before``), the plan's frontier rows from the next step, where it stood after
        this step's draw (``after``); rows are cut back where the LLM rejected a pending token; the
        LLM's rows stop waiting; every writer has one token more (a speculating row's is pending, with its stream
        before and after the SLM's draw: ``before``, ``after``, and the SLM's probability of it, ``chances``;
        ``streams``: each writer's stream after the step, where the batch keeps them); what is confirmed moves on.
        The one writer of a row's progress."""
        for r in plan.routed:
            if r not in plan.ended and r not in plan.speculating:
                self.rows[r].waiting_since, self.rows[r].rng = plan.step, before.get(r)
        for r in plan.frontier:  # its next position routes for sure: it waits from the next step, proposing nothing
            self.rows[r].waiting_since, self.rows[r].rng = plan.step + 1, after.get(r)
        self._tally(outcome)
        kept = {r: self.rows[r].tail[outcome.rollbacks[r] - self.rows[r].confirmed].by_llm for r in outcome.kept}
        for r, index in outcome.rollbacks.items():
            self._cut(r, index)
        llm = set(outcome.llm_writers)
        for r in llm | set(plan.llm_writers):  # (where a rollback cut a waiting row back, its wait is over too)
            self.rows[r].waiting_since = self.rows[r].rng = None
        written = {}
        for r in outcome.writers:
            row = self.rows[r]
            row.by_llm = kept[r] if r in kept else r in llm or r in plan.speculating
            if r in plan.speculating:
                row.pending.append(Pending(row.written, plan.step, before.get(r), after.get(r), chances.get(r, 1.0)))
            row.tail.append(Written(row.written, plan.step, row.by_llm, streams.get(r)))
            written[r] = row.written
            row.written += 1
            row.max_new -= 1
            row.draining = row.max_new <= 0
        for r in outcome.resolved:  # every pending position the LLM read is settled: confirmed, or cut away
            self.rows[r].pending = []
        self.step_no += 1
        return Applied(written, self._confirm())

    def _tally(self, outcome: Outcome) -> None:
        """Each row's speculative counts and its own depth by acceptance (``plan.adapted``), before its pending
        positions are settled or cut."""
        for r in outcome.resolved:
            self.rows[r].speculated.resolved += len(self.rows[r].pending)
        for r, (agreed, rejected, thrown) in outcome.tally.items():
            row = self.rows[r]
            counts = row.speculated
            counts.agreed, counts.rejected, counts.thrown = (counts.agreed + agreed, counts.rejected + rejected,
                                                             counts.thrown + thrown)
            if outcome.held.get(r):
                counts.drafts += 1
                row.drafting = adapted(row.drafting, outcome.held[r], agreed, bool(rejected))

    def _cut(self, r: int, index: int) -> None:
        """Row ``r`` back to its first ``index`` answer tokens (those past it are thrown away)."""
        row = self.rows[r]
        row.pending = [p for p in row.pending if p.index < index]
        row.max_new += row.written - index
        row.tail = row.tail[: index - row.confirmed]
        row.arrived = row.arrived[: max(index - row.delivered, 0)]
        row.written, row.draining = index, False

    def _confirm(self) -> dict[int, list[Written]]:
        """Tokens before a row's first pending position are confirmed (in lockstep, before every row's); the newly
        confirmed ones per row."""
        live = [(r, row) for r, row in enumerate(self.rows) if row is not None]
        upto = {r: row.pending[0].index if row.pending else row.written for r, row in live}
        if self.lockstep and live:
            upto = dict.fromkeys(upto, min(upto.values()))
        confirmed = {}
        for r, row in live:
            new = upto[r] - row.confirmed
            if new > 0:
                confirmed[r], row.tail = row.tail[:new], row.tail[new:]
                row.confirmed += new
        return confirmed
