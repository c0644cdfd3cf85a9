"""Recorded routing replayed through the real schedule, with a cost per forward in place of the models.

An answer's routing belongs to the answer (a row answers what it answers alone, whatever the policy or its
neighbours), so the answers a run served, with which of their tokens the LLM wrote, can be served again under
another policy, concurrency or machine. ``ReplayBatch`` is a running batch without models: the real
``core.turn.turn`` drives it, the real ``core.plan.plan_step`` decides each step, a ``core.layouts.slot_book.SlotBook``
plans each read's forwards as the server's slots do, and each forward adds what ``Costs`` says to the clock
(``benchmarks/serve_model.py``). Only the device work is replaced: which rows propose, who routes (the
recording), what the LLM and SLM read, and when each token reaches the host are the server's own decisions.
"""

from __future__ import annotations

import collections
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Protocol

from r2r_hf.core.counters import Counters
from r2r_hf.core.layouts.slot_book import PIECE, SlotBook
from r2r_hf.core.plan import StepPlan
from r2r_hf.core.rows import BatchRows, RowState
from r2r_hf.core.policy import WaitPolicy
from r2r_hf.core.step import Synced
from r2r_hf.core.turn import turn


class Costs(Protocol):
    def forward(self, role: str, rows: int, tokens: int) -> float: ...

    router: tuple[float, float]
    step: float


@dataclass
class Answer:
    """One recorded answer: its prompt's length, who wrote each token (True: the LLM), and when each reached the
    host in the replay."""

    prompt: int
    routed: list[bool]
    times: list[float] = field(default_factory=list)


class ReplayBatch(BatchRows):
    """A running batch of slots without models (see the module docstring).

    Args:
        slots: rows at most.
        costs: seconds per forward, router call and host step.
    """

    layout = SimpleNamespace(reads_every_row=False)  # the server's slots: the LLM reads the rows it writes

    def __init__(self, slots: int, costs: Costs) -> None:
        super().__init__(slots)
        self.book, self.costs, self.counters = SlotBook(slots), costs, Counters()
        self.clock = 0.0
        self.last = [-1] * slots  # whether each slot committed a token at the last step (0) or not (-1)

    def join(self, answer: Answer) -> None:
        slot = self.rows.index(None)
        self.book.place(slot, answer.prompt)
        self.rows[slot] = RowState(owner=answer, max_new=len(answer.routed), prefilling=True)

    def leave(self, rows: list[int]) -> None:
        for r in rows:
            self.rows[r], self.last[r] = None, -1
            self.book.free(r)

    def prefill(self, limit: int | None) -> None:
        """As ``SlotLayout.prefill``: the LLM reads all but the last prompt token, the SLM the whole prompt."""
        rows = self.prefilling()
        llm_rows = [r for r in rows if self.book.unread("llm", r) > 1]
        if llm_rows:
            self._read("llm", llm_rows, limit, short=1)
        self._read("slm", rows, limit)
        for r in rows:
            self.rows[r].prefilling = self.book.unread("slm", r) > 0

    def propose(self, speculate: bool = False) -> SimpleNamespace:
        rows = self.proposing()
        if rows:
            self.clock += self.costs.router[0] + self.costs.router[1] * len(rows)
        routed = [self.rows[r].owner.routed[len(self.rows[r].owner.routed) - self.rows[r].max_new] for r in rows]
        return SimpleNamespace(rows=rows, routed=routed, states={}, after={})

    def sync(self, proposal: SimpleNamespace, extra: tuple = ()) -> Synced:
        self.counters.host_syncs += 1
        return Synced(list(proposal.routed), self.arrive(self.last), set(), [])

    def execute(self, proposal: SimpleNamespace, synced: Synced, plan: StepPlan) -> SimpleNamespace:
        self.start_waiting(plan, proposal.states)
        if plan.llm_writers:
            self._read("llm", list(plan.llm_reads))
        self.last = [-1] * len(self.rows)
        for r in plan.writers:
            self.book.length[r] += 1
            self.last[r] = 0
        if plan.slm_reads:
            self._read("slm", list(plan.slm_reads))
        self.clock += self.costs.step
        self.advance(plan)
        self.counters.step(plan)
        return SimpleNamespace(plan=plan, synced=synced)

    def _read(self, role: str, rows: list[int], limit: int | None = None, short: int = 0) -> None:
        for forward in self.book.read(role, rows, limit, short, PIECE):
            self.clock += self.costs.forward(role, len(forward), max(n for _, _, n in forward))
            self.counters.forward(role, len(forward), max(n for _, _, n in forward))


class Arrivals:
    """The replay's stop rule (``core.turn.Stops``): a token reaches its answer at the synchronisation after it
    was committed, as in the server; an answer ends with its last recorded token."""

    def __init__(self, batch: ReplayBatch) -> None:
        self.batch, self.done = batch, []

    def reads(self) -> tuple:
        return ()

    def ended(self, synced: Synced) -> dict[int, int]:
        ended = {}
        for r in self.batch.occupied():
            answer = self.batch.rows[r].owner
            answer.times += [self.batch.clock] * len(synced.delivered[r])
            if synced.delivered[r] and len(answer.times) == len(answer.routed):
                ended[r] = len(synced.delivered[r])
                self.done.append(answer)
        return ended


def replay(answers: list[tuple[int, list[bool]]], concurrency: int, policy: WaitPolicy, costs: Costs,
           slots: int = 16, chunk: int = 256, trace: bool = False) -> tuple[ReplayBatch, list[Answer]]:
    """Serve ``answers`` (prompt length, routed flag per token) in order, ``concurrency`` at a time (closed loop: a
    request is sent when an earlier one ends), each turn the engine's; the batch (clock, counters; with ``trace``
    the shape of every forward in ``counters.shapes``) and the answers served, in the order they ended."""
    batch = ReplayBatch(slots, costs)
    batch.counters.shapes = [] if trace else None
    queue = collections.deque(Answer(prompt, list(routed)) for prompt, routed in answers)
    arrivals = Arrivals(batch)
    while queue or batch.occupied():
        while queue and len(batch.occupied()) < min(concurrency, slots):
            batch.join(queue.popleft())
        turn(batch, policy, arrivals, chunk)
    return batch, arrivals.done
