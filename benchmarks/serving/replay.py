"""Recorded routing replayed through the real schedule, with a cost per forward in place of the models.

An answer's routing belongs to the answer (a row answers what it answers alone, whatever the policy or its
neighbours), so the answers a run served, with which of their tokens the LLM wrote, can be served again under
another policy, concurrency or machine. ``ReplayBatch`` is a running batch without models: the real
``core.turn.turn`` drives it, the real ``core.plan.plan_step`` and ``settle`` decide each step and the real ledger
applies it; a ``core.layouts.slot_book.SlotBook`` plans each read's forwards as the server's slots do, and each
forward adds what ``Costs`` says to the ``Clock`` (``benchmarks/serving/cost_model.py``). Only the device work is
replaced: which rows propose, who routes (the
recording), what the LLM and SLM read, and when each token reaches the host are the server's own decisions.

Speculative routing (``core/speculation.py``) replays through the same ``plan_step``, ``plan.settle`` and
``Ledger.apply``: each recorded token also says whether the LLM's token there equals the SLM's proposal
(``Routed.agrees``, read at routed positions), so a resolution rejects a row's first pending position the LLM
does not confirm and cuts the row back there, as the device does. One approximation: after a rollback the row
goes on with the recorded routing from the rejected index, which is exact for the answer it ends with (R2R's own),
but the thrown-away tail was written after the SLM's token, not the LLM's, and its own routing was never recorded:
the recorded continuation stands in for it (how many pending positions the tail gathered, hence when the LLM ran).

A model with recurrent layers (``Costs.recurrent``: Gated DeltaNet, Mamba...) is read as the server's slots read it
(``core/layouts/slot_state.py``): no row of a forward is padded, so every row reads as many tokens, one of the
captured widths, and a catch-up of rows with different counts takes several forwards; its state is checkpointed where
speculation keeps it (the SLM's when a row first speculates, the LLM's per resolving row) and a cut puts the row back
there, the model reading again from the checkpoint; each copy is priced (``Costs.state_copy``).
"""

from __future__ import annotations

import collections
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Protocol

from r2r_hf.core.counters import Counters
from r2r_hf.core.fast.fused import attended
from r2r_hf.core.fast.slot_reads import row_buckets
from r2r_hf.core.fast.static_reads import BUCKETS, bucket_for
from r2r_hf.core.layouts.packed import tokens_bucket
from r2r_hf.core.layouts.slot_book import PIECE, SlotBook
from r2r_hf.core.ledger import Ledger, RowState
from r2r_hf.core.moves import BlockPlan, Drafted, draft_on_host
from r2r_hf.core.plan import Outcome, StepPlan
from r2r_hf.core.policy import WaitPolicy
from r2r_hf.core.staging import CHANCE_UNIT
from r2r_hf.core.step import LLMRead, Synced
from r2r_hf.core.turn import turn


class Costs(Protocol):
    def forward(self, role: str, rows: int, tokens: int, span: int = 0) -> float: ...

    router: tuple[float, float]
    step: float
    packed: bool  # a forward of ragged rows priced by its mean tokens per row, not its longest (a what-if)
    captured_shapes: bool  # priced at the captured read's shape: the rows bucket of its highest slot, tokens bucket
    gathered_rows: bool  # with captured_shapes: an LLM read at the smaller of that and its rows' own bucket (the
    # server's LLM reads gather their rows since the first device run; the SLM's read the first slots)
    # optional (``cost_model.Costs``): ``recurrent``, ``widths``, ``split``, ``rewind`` (which models keep recurrent
    # state, and how the replay reads and cuts them back), ``capacity`` (the slots' columns: a read's attended span),
    # ``state_copy(role, rows)`` (seconds to copy rows' recurrent state once)


class Routed(list):
    """An answer's routing: who wrote each token (True: the LLM), as a list, ``agrees``: at each token, whether
    the LLM's token there equals the SLM's proposal (read at routed positions only; None: recorded nowhere, taken
    as agreeing everywhere), and ``chances``: the SLM's probability of its proposal at each token (what the
    expected-gain rule reads, ``WaitPolicy.draft_cost``; None: not recorded, 1.0 everywhere)."""

    def __init__(self, flags=(), agrees: list[bool] | None = None, chances: list[float] | None = None) -> None:
        super().__init__(flags)
        self.agrees = None if agrees is None else list(agrees)
        self.chances = None if chances is None else list(chances)
        for name, values in (("agreement flags", self.agrees), ("probabilities", self.chances)):
            if values is not None and len(values) != len(self):
                raise ValueError(f"{len(values)} {name} for {len(self)} tokens")


@dataclass
class Answer:
    """One recorded answer: its prompt's length, who wrote each token (True: the LLM), whether the LLM agrees with
    the SLM's proposal at each (``Routed.agrees``; speculation reads it at pending positions), and when each token
    reached the host in the replay."""

    prompt: int
    routed: list[bool]
    agrees: list[bool] | None = None
    times: list[float] = field(default_factory=list)
    routes: bool | None = None  # its routing is fixed (``RowState.routes``: True at threshold 0, no router step)
    chances: list[float] | None = None  # the SLM's probability of each proposal (``Routed.chances``)

    def __post_init__(self) -> None:
        if self.agrees is None:  # no disagreement recorded
            self.agrees = [True] * len(self.routed)
        # (as the host reads them back from the device: whole CHANCE_UNITs, so the rule reads the server's numbers)
        self.chances = [round(p * CHANCE_UNIT) / CHANCE_UNIT for p in self.chances or [1.0] * len(self.routed)]

    def at(self, max_new: int) -> int:
        """The index of the token a row with ``max_new`` tokens left proposes next."""
        return len(self.routed) - max_new


class Clock:
    """The replay's time: each forward, router call and host step adds what ``Costs`` says, by what it was spent on.
    A read is planned into forwards as the server's slots plan it (``SlotBook.read``) and priced at the shape the
    server runs it at (``Costs``' switches)."""

    def __init__(self, costs: Costs, book: SlotBook, counters: Counters) -> None:
        self.costs, self.book, self.counters = costs, book, counters
        self.now = 0.0
        self.spent = dict.fromkeys(("slm", "llm", "router", "host"), 0.0)
        self.copies = dict.fromkeys(("slm", "llm"), 0)  # rows of recurrent state checkpointed or restored

    def widths(self, role: str) -> tuple[int, ...] | None:
        """The widths a forward of ``role`` may take where its model has recurrent layers (every row of a forward
        reads as many tokens: ``SlotBook.read``), else None (rows padded)."""
        costs = self.costs
        if role in getattr(costs, "recurrent", ()) and getattr(costs, "split", True):
            return tuple(costs.widths)
        return None

    def rewinds(self, role: str) -> bool:
        """Whether ``role``'s rows go back to a checkpoint of their recurrent state when cut (``SlotLayout.cut``)."""
        return role in getattr(self.costs, "recurrent", ()) and getattr(self.costs, "rewind", True)

    def keep(self, role: str, rows: list[int]) -> None:
        """``role``'s recurrent state of ``rows`` checkpointed where it has read them (``SlotLayout.keep``: before it
        reads a token a rollback may cut), one state copy per row; nothing for a model without recurrent layers."""
        if rows and self.rewinds(role):
            self.book.keep(role, rows)
            self.copy(role, len(rows))

    def cut(self, row: int, index: int) -> None:
        """``row`` back to its first ``index`` answer tokens (``SlotLayout.cut``): a recurrent model that read past
        them is restored to its checkpoint (one state copy) and reads again from there."""
        for role in self.book.cut(row, index):
            if self.rewinds(role):
                self.book.restore(role, row)
                self.copy(role, 1)

    def copy(self, role: str, rows: int) -> None:
        state_copy = getattr(self.costs, "state_copy", None)
        self.copies[role] += rows
        if state_copy is not None:
            self.spend(role, state_copy(role, rows))

    def spend(self, what: str, seconds: float) -> None:
        self.now += seconds
        self.spent[what] += seconds

    def read(self, role: str, rows: list[int], limit: int | None = None, short: int = 0,
             upto: dict[int, int] | None = None) -> None:
        """``role`` reads ``rows`` as the server would (the LLM's reads packed where ``Costs.packed``, the prompt
        pieces riding in them: ``SlotBook.packed``), each forward priced."""
        if not rows:
            return
        widths = self.widths(role)
        if self.packs(role):
            forwards = self.book.packed(rows, limit, short, upto)
        else:  # (a recurrent model's pieces are its widest width: the captured server's 64, the eager one's 256)
            forwards = self.book.read(role, rows, limit, short, max(widths) if widths else PIECE, upto, widths)
        for forward in forwards:
            self.price(role, forward)

    def prompt(self, rows: list[int], limit: int | None) -> None:
        """The LLM's share of a prefill turn: all but the last prompt token, read now, or riding in its next read."""
        rows = [r for r in rows if self.book.unread("llm", r) > 1]
        if not self.packs("llm"):
            self.read("llm", rows, limit, short=1)
            return
        for forward in self.book.ride(rows, limit):
            self.price("llm", forward)

    def block(self, drafted: Drafted) -> None:
        """A draft block's price: the SLM's read of every slot per drafted step, back to back (the router folded in
        them), one host step for the block and the planning of its other steps."""
        for _ in drafted.token:  # (each slot's last column: the span its read attends)
            self.price("slm", [(r, max(n - 1, 0), 1) for r, n in enumerate(self.book.length)])
        self.spend("host", self.costs.step + (len(drafted.token) - 1) * getattr(self.costs, "plan", 0.0))

    def packs(self, role: str) -> bool:
        return role == "llm" and getattr(self.costs, "packed", False)

    def price(self, role: str, forward: list[tuple[int, int, int]]) -> None:
        """One forward of (row, first column, tokens), at the shape the server runs it: a packed read at its tokens
        bucket; a captured padded read at its rows bucket (of its highest slot, or of its rows where the LLM's reads
        gather them) x tokens bucket, in replays of at most the widest; else rows x its longest row. Each attends the
        span of its longest row (``fused.attended`` where the costs name the slots' ``capacity``)."""
        costs, slots = self.costs, len(self.book.length)
        real, longest = sum(n for _, _, n in forward), max(n for _, _, n in forward)
        filled = max(start + n for _, start, n in forward)
        span = attended(filled, costs.capacity) if hasattr(costs, "capacity") else filled
        if self.packs(role):
            shapes = [(1, tokens_bucket(real))]
        elif getattr(costs, "captured_shapes", False):  # the captured graphs' own shapes (fast/slot_reads.py)
            buckets = row_buckets(slots)
            k = next(b for b in buckets if b > max(r for r, _, _ in forward))
            if role == "llm" and getattr(costs, "gathered_rows", False):
                k = min(k, next(b for b in buckets if b >= len(forward)))
            shapes = [(k, bucket_for(min(longest - start, BUCKETS[-1]))) for start in range(0, longest, BUCKETS[-1])]
        else:
            shapes = [(len(forward), longest)]
        for k, width in shapes:
            self.spend(role, costs.forward(role, k, width, span))
        self.counters.forward(role, len(forward), longest, real, sum(k * width for k, width in shapes))


class ReplayBatch:
    """A running batch of slots without models (see the module docstring): a ``core.turn.DeviceStep`` whose
    forwards the ``clock`` prices; the ledger, the plans and the outcomes are the server's own."""

    lockstep = False  # the server's slots: the LLM reads the rows it writes, a rollback cuts one row

    def __init__(self, slots: int, costs: Costs) -> None:
        self.ledger, self.book, self.counters = Ledger(slots), SlotBook(slots), Counters()
        self.clock = Clock(costs, self.book, self.counters)
        self.last = [-1] * slots  # whether each slot committed a token at the last step (0) or not (-1)

    def join(self, answer: Answer) -> None:
        slot = self.ledger.rows.index(None)
        self.book.place(slot, answer.prompt)
        self.ledger.admit(slot, RowState(owner=answer, max_new=len(answer.routed), prefilling=True,
                                         routes=answer.routes))

    def leave(self, rows: list[int]) -> None:
        self.ledger.release(rows)
        for r in rows:
            self.last[r] = -1
            self.book.free(r)

    def prefill(self, limit: int | None) -> None:
        """As ``SlotLayout.prefill``: the LLM reads all but the last prompt token, the SLM the whole prompt."""
        rows = self.ledger.prefilling()
        self.clock.prompt(rows, limit)
        self.clock.read("slm", rows, limit)
        self.ledger.ready([r for r in rows if not self.book.unread("slm", r)])

    def propose(self, policy: WaitPolicy) -> SimpleNamespace:
        """The recorded routing of each proposing row's next token (a stream's states are not modelled)."""
        rows = [(r, self.ledger.rows[r]) for r in self.ledger.proposing()]
        if scored := sum(row.routes is None for _, row in rows):  # (fixed routing: no router step)
            self.clock.spend("router", self.clock.costs.router[0] + self.clock.costs.router[1] * scored)
        routed = [row.owner.routed[row.owner.at(row.max_new)] for _, row in rows]
        chance = [row.owner.chances[row.owner.at(row.max_new)] for _, row in rows] if policy.draft_cost else []
        return SimpleNamespace(rows=[r for r, _ in rows], routed=routed, chance=chance, states={}, after={})

    def sync(self, proposal: SimpleNamespace, extra: tuple = ()) -> Synced:
        self.counters.host_syncs += 1
        return Synced(list(proposal.routed), self.ledger.arrive(self.last), set(), [], chance=proposal.chance)

    def read_llm(self, plan: StepPlan, proposal: SimpleNamespace) -> LLMRead:
        """As the running batch's: a catch-up, or a resolution (``resolution``: one host synchronisation)."""
        if not plan.resolving:
            self.clock.read("llm", list(plan.llm_reads))
            return LLMRead()
        self.counters.host_syncs += 1
        return resolution(self.ledger.rows, plan, self.clock)

    def draft(self, plan: BlockPlan) -> Drafted:
        """As the running batch's draft block (every row taken as greedy: a recording has no sampling); the rows that
        may speculate inside it have their SLM state checkpointed first (``RunningBatch.draft``)."""
        self.clock.keep("slm", [r for r in plan.rows if plan.standing[r].depth and not plan.standing[r].pending])
        drafted = drafted_block(self.ledger, self.book, plan, self.last)
        self.clock.block(drafted)
        return drafted

    def delivers(self, tokens: list[int]) -> None:  # as the running batch's (0: a token, -1: none)
        self.last = list(tokens)

    def commit(self, proposal: SimpleNamespace, plan: StepPlan, outcome: Outcome, read: LLMRead) -> tuple:
        """As the running batch's: rollbacks, one token more for each writer, the SLM's state checkpointed for a row's
        first pending token, the SLM's read, the host's step."""
        for r, index in outcome.rollbacks.items():
            self.clock.cut(r, index)
        self.last = [0 if r in outcome.writers else -1 for r in range(len(self.ledger.rows))]
        for r in outcome.writers:
            self.book.length[r] += 1
        self.clock.keep("slm", [r for r in plan.speculating if not self.ledger.rows[r].pending])
        self.clock.read("slm", list(outcome.slm_reads))
        self.clock.spend("host", self.clock.costs.step)  # (a resolution's read-back: in the serial step's time)
        return None, {}


def resolution(rows: list, plan: StepPlan, clock: Clock) -> LLMRead:
    """A resolution over recorded routing: one LLM read of each resolving row through the token before its last
    pending position (of each writer through its last token), rejecting a row's first pending position the recording
    says the LLM does not confirm (``Routed.agrees``)."""
    needs = {r: [p.index for p in rows[r].pending] for r in plan.resolving}
    for r in plan.llm_writers:
        needs.setdefault(r, []).append(rows[r].written)
    clock.keep("llm", list(plan.resolving))  # its state before it reads a pending token (``speculation.resolve``)
    clock.read("llm", sorted(needs), upto={r: clock.book.prompt[r] + max(n) for r, n in needs.items()})
    agrees = {r: rows[r].owner.agrees for r in plan.resolving}
    return LLMRead(rejected={r: next((j for j, p in enumerate(rows[r].pending) if not agrees[r][p.index]), None)
                             for r in plan.resolving})


def drafted_block(ledger: Ledger, book: SlotBook, plan: BlockPlan, previous: list[int]) -> Drafted:
    """What a draft block (``core/fast/drafts.py``) drafts over recorded routing: the device's block on the host
    (``core.moves.draft_on_host``), each row proposing its recorded routing at its next token (the router is never
    sure: the recording has no scores; the tokens are not recorded), each slot's length in ``book`` moved on by the
    tokens it committed and the SLM's read of them (``SlotLayout.drafted``)."""
    owner = {r: ledger.rows[r].owner for r in plan.rows}
    start = {r: owner[r].at(ledger.rows[r].max_new) for r in plan.rows}

    def recorded(r: int, written: int) -> tuple[int, bool, bool, float]:  # (token, routed, sure, chance)
        return 0, owner[r].routed[start[r] + written], False, owner[r].chances[start[r] + written]

    drafted = draft_on_host(plan, previous, recorded)
    for committed, read in zip(drafted.committed, drafted.read):
        for r in plan.rows:
            book.length[r] += committed[r]
            book.seen["slm"][r] += read[r]
    return drafted


class Arrivals:
    """The replay's stop rule (``core.turn.Stops``): a token reaches its answer at the synchronisation after it
    was committed, as in the server; an answer ends with its last recorded token."""

    def __init__(self, batch: ReplayBatch) -> None:
        self.batch, self.done = batch, []

    def reads(self) -> tuple:
        return ()

    def ended(self, synced: Synced) -> dict[int, int]:
        ended = {}
        for r in self.batch.ledger.occupied():
            answer = self.batch.ledger.rows[r].owner
            answer.times += [self.batch.clock.now] * len(synced.delivered[r])
            if synced.delivered[r] and len(answer.times) == len(answer.routed):
                ended[r] = len(synced.delivered[r])
                self.done.append(answer)
        return ended


def replay(answers: list[tuple[int, list[bool]]], concurrency: int, policy: WaitPolicy, costs: Costs,
           slots: int = 16, chunk: int = 256, trace: bool = False,
           routes: bool | None = None) -> tuple[ReplayBatch, list[Answer]]:
    """Serve ``answers`` (prompt length, routed flag per token; a ``Routed`` carries the LLM's agreement) in order,
    ``concurrency`` at a time (closed loop: a request is sent when an earlier one ends), each turn the engine's; the
    batch (clock, counters; with ``trace`` the shape of every forward in ``counters.shapes``) and the answers
    served, in the order they ended. ``routes``: every answer's routing is fixed (True: threshold 0, every token
    routes, the router never runs, confirmed tails take their frontier token)."""
    batch = ReplayBatch(slots, costs)
    batch.counters.shapes = [] if trace else None
    queue = collections.deque(Answer(prompt, list(routed), getattr(routed, "agrees", None), routes=routes,
                                     chances=getattr(routed, "chances", None)) for prompt, routed in answers)
    arrivals = Arrivals(batch)
    most = 32 * sum(len(routed) + prompt for prompt, routed in answers) + 1000  # far more turns than any replay takes
    for _ in range(most):
        if not (queue or batch.ledger.occupied()):
            return batch, arrivals.done
        while queue and len(batch.ledger.occupied()) < min(concurrency, slots):
            batch.join(queue.popleft())
        turn(batch, policy, arrivals, chunk)
    raise RuntimeError(f"the replay did not end within {most} turns: its rows make no progress (a defect in the "
                       f"replay or the schedule)")
