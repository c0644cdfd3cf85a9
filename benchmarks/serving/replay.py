"""Recorded routing replayed through the real schedule, with a cost per forward in place of the models.

An answer's routing belongs to the answer (a row answers what it answers alone, whatever the policy or its
neighbours), so the answers a run served, with which of their tokens the LLM wrote, can be served again under
another policy, concurrency or machine. ``ReplayBatch`` is a running batch without models: the real
``core.turn.turn`` drives it, the real ``core.plan.plan_step`` decides each step, a ``core.layouts.slot_book.SlotBook``
plans each read's forwards as the server's slots do, and each forward adds what ``Costs`` says to the clock
(``benchmarks/serving/cost_model.py``). Only the device work is replaced: which rows propose, who routes (the
recording), what the LLM and SLM read, and when each token reaches the host are the server's own decisions.

Speculative routing (``core/speculation.py``) replays through the same ``plan_step``, ``plan.settle`` and
``BatchRows.advance``: each recorded token also says whether the LLM's token there equals the SLM's proposal
(``Routed.agrees``, read at routed positions), so a resolution rejects a row's first pending position the LLM
does not confirm and cuts the row back there, as the device does. One approximation: after a rollback the row
goes on with the recorded routing from the rejected index, which is exact for the answer it ends with (R2R's own),
but the thrown-away tail was written after the SLM's token, not the LLM's, and its own routing was never recorded:
the recorded continuation stands in for it (how many pending positions the tail gathered, hence when the LLM ran).
"""

from __future__ import annotations

import collections
import math
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Protocol

from r2r_hf.core.counters import Counters
from r2r_hf.core.layouts.slot_book import PIECE, SlotBook
from r2r_hf.core.plan import Settlement, StepPlan, settle
from r2r_hf.core.fast.slot_reads import row_buckets
from r2r_hf.core.fast.static_reads import BUCKETS, bucket_for
from r2r_hf.core.rows import BatchRows, RowState
from r2r_hf.core.policy import WaitPolicy
from r2r_hf.core.step import Synced
from r2r_hf.core.turn import turn


class Costs(Protocol):
    def forward(self, role: str, rows: int, tokens: int) -> float: ...

    router: tuple[float, float]
    step: float
    packed: bool  # a forward of ragged rows priced by its mean tokens per row, not its longest (a what-if)
    captured_shapes: bool  # priced at the captured read's shape: the rows bucket of its highest slot, tokens bucket
    gathered_rows: bool  # with captured_shapes: an LLM read at the smaller of that and its rows' own bucket (the
    # server's LLM reads gather their rows since the first device run; the SLM's read the first slots)


class Routed(list):
    """An answer's routing: who wrote each token (True: the LLM), as a list, and ``agrees``: at each token, whether
    the LLM's token there equals the SLM's proposal (read at routed positions only; None: recorded nowhere, taken
    as agreeing everywhere)."""

    def __init__(self, flags=(), agrees: list[bool] | None = None) -> None:
        super().__init__(flags)
        self.agrees = None if agrees is None else list(agrees)
        if self.agrees is not None and len(self.agrees) != len(self):
            raise ValueError(f"{len(self.agrees)} agreement flags for {len(self)} tokens")


@dataclass
class Answer:
    """One recorded answer: its prompt's length, who wrote each token (True: the LLM), whether the LLM agrees with
    the SLM's proposal at each (``Routed.agrees``; speculation reads it at pending positions), and when each token
    reached the host in the replay."""

    prompt: int
    routed: list[bool]
    agrees: list[bool] | None = None
    times: list[float] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.agrees is None:  # no disagreement recorded
            self.agrees = [True] * len(self.routed)


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
        self.spent = dict.fromkeys(("slm", "llm", "router", "host"), 0.0)  # the clock, by what it was spent on
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

    def propose(self, speculate: bool = False, speculate_below: float = math.inf) -> SimpleNamespace:
        """The recorded routing of each proposing row's next token (a stream's states are not modelled)."""
        rows = self.proposing()
        if rows:
            self._spend("router", self.costs.router[0] + self.costs.router[1] * len(rows))
        routed = [self.rows[r].owner.routed[len(self.rows[r].owner.routed) - self.rows[r].max_new] for r in rows]
        return SimpleNamespace(rows=rows, routed=routed, states={}, after={})

    def sync(self, proposal: SimpleNamespace, extra: tuple = ()) -> Synced:
        self.counters.host_syncs += 1
        return Synced(list(proposal.routed), self.arrive(self.last), set(), [])

    def execute(self, proposal: SimpleNamespace, synced: Synced, plan: StepPlan) -> SimpleNamespace:
        """As ``DeviceStep.execute``: the LLM's read (a catch-up, or a resolution), the commits, the SLM's read."""
        self.start_waiting(plan, proposal.states)
        settled = None
        if plan.resolving:
            settled = self._resolve(plan)
        elif plan.llm_writers:
            self._read("llm", list(plan.llm_reads))
        writers = plan.writers if settled is None else settled.writers
        self.last = [-1] * len(self.rows)
        for r in writers:
            self.book.length[r] += 1
            self.last[r] = 0
        reads = plan.slm_reads if settled is None else settled.slm_reads
        if reads:
            self._read("slm", list(reads))
        self._spend("host", self.costs.step)  # (a resolution's read-back of its rejections: in the serial step's time)
        self.advance(plan, settled)
        self.counters.step(plan)
        return SimpleNamespace(plan=plan, synced=synced, settled=settled)

    def _resolve(self, plan: StepPlan) -> Settlement:
        """As ``speculation.resolve``: one LLM read of each resolving row through the token before its last pending
        position (of each writer through its last token), a row rejected at its first pending position the
        recording says the LLM does not confirm, and the rejected rows cut back there."""
        needs = {r: [p.index for p in self.rows[r].pending] for r in plan.resolving}
        for r in plan.llm_writers:
            needs.setdefault(r, []).append(self.rows[r].written)
        rows = sorted(needs)
        self._read("llm", rows, upto={r: self.book.prompt[r] + max(needs[r]) for r in rows})
        rejected = {r: next((j for j, p in enumerate(self.rows[r].pending) if not self.rows[r].owner.agrees[p.index]),
                            None) for r in plan.resolving}
        settled = settle(self.rows, plan, rejected, cuts_together=False)
        self.counters.host_syncs += 1  # the resolution's own, as the real batch's
        for r, index in settled.rollbacks.items():
            self.book.cut(r, index)
        thrown = sum(self.rows[r].written - index for r, index in settled.rollbacks.items())
        self.counters.resolved(settled.agreed, settled.rejected, thrown)
        return settled

    def _read(self, role: str, rows: list[int], limit: int | None = None, short: int = 0,
              upto: dict[int, int] | None = None) -> None:
        for forward in self.book.read(role, rows, limit, short, PIECE, upto):
            longest = max(n for _, _, n in forward)  # the slots' read is a padded rectangle: rows x the longest
            priced = sum(n for _, _, n in forward) / len(forward) if getattr(self.costs, "packed", False) else longest
            if getattr(self.costs, "captured_shapes", False):  # the captured graphs' own shapes (fast/slot_reads.py)
                buckets = row_buckets(len(self.rows))
                rows = next(b for b in buckets if b > max(r for r, _, _ in forward))
                if role == "llm" and getattr(self.costs, "gathered_rows", False):  # the server's LLM reads gather
                    rows = min(rows, next(b for b in buckets if b >= len(forward)))
                for start in range(0, longest, BUCKETS[-1]):  # replays of at most the widest bucket
                    self._spend(role, self.costs.forward(role, rows, bucket_for(min(longest - start, BUCKETS[-1]))))
            else:
                self._spend(role, self.costs.forward(role, len(forward), priced))
            self.counters.forward(role, len(forward), longest)

    def _spend(self, what: str, seconds: float) -> None:
        self.clock += seconds
        self.spent[what] += seconds


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
    """Serve ``answers`` (prompt length, routed flag per token; a ``Routed`` carries the LLM's agreement) in order,
    ``concurrency`` at a time (closed loop: a request is sent when an earlier one ends), each turn the engine's; the
    batch (clock, counters; with ``trace`` the shape of every forward in ``counters.shapes``) and the answers
    served, in the order they ended."""
    batch = ReplayBatch(slots, costs)
    batch.counters.shapes = [] if trace else None
    queue = collections.deque(Answer(prompt, list(routed), getattr(routed, "agrees", None))
                              for prompt, routed in answers)
    arrivals = Arrivals(batch)
    while queue or batch.occupied():
        while queue and len(batch.occupied()) < min(concurrency, slots):
            batch.join(queue.popleft())
        turn(batch, policy, arrivals, chunk)
    return batch, arrivals.done
