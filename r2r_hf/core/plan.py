"""The step's two decisions as plain values: ``plan_step`` decides what a step does, ``settle`` what it commits.

A step (``turn.decode_step``) proposes on the device and reads what the host needs in one synchronisation; then
``plan_step`` decides, over host values only, which rows write a token (the SLM's, or the LLM's), which go on past a
routed position with the SLM's token (speculation), which wait for the LLM, whether the LLM runs and which rows it
reads, which rows the SLM reads next. The LLM's read follows; where it resolved pending tokens, the first position
of each row it did not confirm comes back from the device, and ``settle`` says what the step commits: the plan as
planned where nothing was rejected, else the rejected rows cut back there with the LLM's token (in lockstep, every
row cut back to the earliest such position). Both are pure: the same functions decide ``generate``'s steps, the
server's and the cost model's replay of recorded routing, and a ``StepPlan`` or ``Outcome`` can be printed,
compared and replayed. The rows' host state they read is the ledger's (``ledger.py``).

Who goes on and who waits is each proposing row's move (``moves.move``: one rule for every step). ``plan_block``
plans a draft block of steps the LLM does not run in, once, before it (``moves.BlockPlan``); the device makes each
drafted step's moves and ``plan_moves`` makes each step's plan from them, as ``plan_step`` does from the host's.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

from .moves import BlockPlan, Move, Standing, draft_ends, move
from .policy import WaitPolicy


@dataclass(frozen=True)
class StepPlan:
    """What one step does (rows are slot numbers, in slot order).

    Args:
        step: the step's number.
        proposed: rows that proposed a token; routed: those whose proposal the router sent to the LLM.
        ended: rows whose answer ended before this step (their previous token ended it, or their draw failed):
            they commit nothing and leave.
        slm_writers: rows that commit the SLM's proposal (routed rows that go on speculatively among them);
            llm_writers: rows the LLM writes a token for (empty: the LLM does not run).
        speculating: routed rows that go on with the SLM's token, held pending until the LLM resolves it.
        resolving: rows whose pending positions the LLM resolves in this step.
        llm_reads: rows the LLM reads its unread tokens of (writers and resolving rows; every row in lockstep).
        waiting: rows that wait for the LLM after this step.
        slm_reads: rows the SLM reads the committed token of (writers that will propose again), unless a
            resolution cuts rows back (``Outcome.slm_reads``).
        waited: steps each LLM writer waited (0: routed in this step).
        frontier: speculating rows that route everywhere (``RowState.routes``) and now hold as many pending positions
            as they may: their next token is the LLM's whatever the SLM proposes, so they wait from the next step
            without proposing (the SLM does not read their token now) and the resolution of their tail also gives
            that token (the *frontier token*: no SLM step, no second LLM forward spent on it).
    """

    step: int
    proposed: tuple[int, ...] = ()
    routed: tuple[int, ...] = ()
    ended: tuple[int, ...] = ()
    slm_writers: tuple[int, ...] = ()
    llm_writers: tuple[int, ...] = ()
    speculating: tuple[int, ...] = ()
    resolving: tuple[int, ...] = ()
    llm_reads: tuple[int, ...] = ()
    waiting: tuple[int, ...] = ()
    slm_reads: tuple[int, ...] = ()
    waited: tuple[int, ...] = ()
    frontier: tuple[int, ...] = ()

    @property
    def writers(self) -> tuple[int, ...]:
        """Rows that plan to commit a token this step (``Outcome.writers``: those that do)."""
        return tuple(sorted(self.slm_writers + self.llm_writers))


def plan_step(rows: Sequence, step: int, proposed: Sequence[int], routed: Sequence[bool], ended: set[int],
              policy: WaitPolicy, lockstep: bool = False, sure: Sequence[bool] = (),
              chance: Sequence[float] = ()) -> StepPlan:
    """Decide one step from host values (see the module docstring).

    Args:
        rows: each slot's ``rows.RowState`` before the step (None: free).
        step: the step's number.
        proposed: rows that proposed; routed: the router's decision for each of them.
        ended: rows whose answer ended before this step.
        policy: when the LLM runs, and how many pending positions a row may hold (``WaitPolicy.speculate``); each
            proposing row's move is ``moves.move``'s (a routed row speculates or waits).
        lockstep: the rows move together (HF's rectangle): the LLM reads every row whenever it runs, and a routed
            row cannot wait with no token (the LLM runs instead).
        sure: for each proposing row, whether the router is surer than ``policy.speculate_below`` (it then waits).
        chance: for each proposing row, the SLM's probability of its token (where ``policy.draft_cost`` reads it:
            a row that routes everywhere is unsure too where its draft ends, ``moves.draft_ends``).
    """
    occupied = [r for r, row in enumerate(rows) if row is not None and r not in ended]
    sure, chance = sure or [False] * len(proposed), chance or [1.0] * len(proposed)
    moves, unsure = {}, set()
    for r, hit, certain, p in zip(proposed, routed, sure, chance):
        if r in ended:
            continue
        # (a row that did not route writes whatever it stands: its standing is worked out where it routed only)
        standing = Standing.of(rows[r], depth(rows[r], policy, len(occupied)), policy.draft_cost) if hit else None
        certain = certain or (hit and draft_ends(standing, p))
        moves[r] = move(standing, hit, certain)
        if certain:
            unsure.add(r)
    made = _made(_in_lockstep(rows, moves, unsure) if lockstep else moves, ended)
    speculating = sorted(made.speculates + made.frontier)
    since = {r: rows[r].waiting_since for r in occupied if rows[r].waiting_since is not None}
    since.update(dict.fromkeys(made.waits, step))
    held = {r: rows[r].pending[0].step for r in occupied if rows[r].pending}
    held.update({r: step for r in speculating if r not in held})
    # A row that routes everywhere always holds pending positions: it counts once it waits (its tail full), wrote its
    # last token or holds a tail as old as the policy lets one get (a count of holders: rows the LLM would serve).
    holders = set(since) | {r for r, s in held.items()
                            if not rows[r].routes or rows[r].draining or step - s >= policy.max_wait}
    oldest = max((step - s for s in (*since.values(), *held.values())), default=0)
    stalled = not (made.writes or speculating)
    runs = bool(holders) and (policy.runs(len(holders), len(occupied), oldest, stalled) or (bool(since) and lockstep))
    if not runs:
        return _without_llm(rows, step, proposed, ended, made, since)
    llm_writers = tuple(sorted(set(since).union(speculating)))  # a row routed now is written now
    slm_writers = tuple(made.writes)
    resolving = tuple(r for r in occupied if rows[r].pending)
    reads = tuple(occupied) if lockstep else tuple(sorted(set(llm_writers) | set(resolving)))
    slm_reads = tuple(r for r in sorted(slm_writers + llm_writers) if rows[r].max_new > 1)
    return StepPlan(step, tuple(proposed), made.routed, tuple(sorted(ended)), slm_writers, llm_writers, (),
                    resolving, reads, (), slm_reads, tuple(step - since.get(r, step) for r in llm_writers))


def plan_moves(rows: Sequence, step: int, proposed: Sequence[int], ended: set[int],
               moves: Mapping[int, Move]) -> StepPlan:
    """A step the LLM does not run in, from each proposing row's move (``moves.move``; a draft block's steps from
    the moves the device made: ``turn.decode_block``). Rows in ``ended`` commit nothing."""
    made = _made(moves, ended)
    waiting = [r for r, row in enumerate(rows) if row is not None and r not in ended and row.waiting_since is not None]
    return _without_llm(rows, step, proposed, ended, made, waiting + made.waits)


class _Made(NamedTuple):
    """The proposing rows by the move each made (in slot order)."""

    writes: list[int]
    speculates: list[int]
    waits: list[int]
    frontier: list[int]

    @property
    def routed(self) -> tuple[int, ...]:
        """The rows whose proposal routed (every move but ``WRITES``)."""
        return tuple(sorted(self.speculates + self.waits + self.frontier))


def _made(moves: Mapping[int, Move], ended: set[int]) -> _Made:
    """``moves`` grouped by move, the rows in ``ended`` left out (they commit nothing)."""
    made = _Made([], [], [], [])
    by = {Move.WRITES: made.writes, Move.SPECULATES: made.speculates, Move.WAITS: made.waits,
          Move.FRONTIER: made.frontier}
    for r, m in moves.items():
        if r not in ended:
            by[m].append(r)
    return made


def _without_llm(rows: Sequence, step: int, proposed: Sequence[int], ended: set[int], made: _Made,
                 waiting: Iterable[int]) -> StepPlan:
    """The plan of a step the LLM does not run in: rows that commit write the SLM's token (pending where they
    routed), the ``waiting`` rows (those that waited, and those that wait now) and the frontier rows wait after it,
    the SLM reads the committed tokens of the rest that propose again."""
    writers, last = sorted(made.writes + made.speculates + made.frontier), set(made.frontier)
    slm_reads = tuple(r for r in writers if rows[r].max_new > 1 and r not in last)
    return StepPlan(step, tuple(proposed), made.routed, tuple(sorted(ended)), tuple(writers), (),
                    tuple(sorted(made.speculates + made.frontier)), waiting=tuple(sorted(last.union(waiting))),
                    slm_reads=slm_reads, frontier=tuple(made.frontier))


def depth(row, policy: WaitPolicy, running: int) -> int:
    """Pending positions ``row`` may hold among ``running`` rows: the policy's (by load where it routes everywhere:
    ``WaitPolicy.depth``), less where it routes everywhere and its own drafts say so (``RowState.drafting``, where the
    policy ``adapts``), or less where its request asked (``RowState.depth``)."""
    most = policy.depth(running, bool(row.routes))
    if policy.adapts and row.routes and not policy.draft_cost:
        most = min(most, row.drafting)
    return most if row.depth is None else min(most, row.depth)


# A row's own depth by acceptance (``adapted``): chosen by measurement on the real pair (teacher-forced traces of 30
# HumanEval answers, 9,393 tokens, LLM-SLM agreement 0.98, replayed at batch 1 with this CPU's measured costs, against
# fixed depths, HF assisted generation's +2 / -1 and halving rules; ``benchmarks/speed/depth_rules.py``): rejections
# cluster (hard spans of code), so a draft after one should be short and one after a run of confirmed drafts long.
DRAFT_FIRST, DRAFT_FLOOR, DRAFT_GROWTH = 4, 2, 4


def adapted(drafting: int, held: int, agreed: int, rejected: bool) -> int:
    """A row's next depth (``RowState.drafting``) once the LLM judged a tail of ``held`` pending positions, ``agreed``
    of them confirmed: ``DRAFT_FLOOR`` after a rejection; ``DRAFT_GROWTH`` more after a tail as deep as it was let
    go, confirmed whole; else as it was (a tail cut short by the SLM's doubt, the answer's end, the policy's wait or a
    neighbour's rollback says nothing of a deeper draft). It changes only when the LLM reads, never what it writes."""
    if rejected:
        return DRAFT_FLOOR
    return drafting + DRAFT_GROWTH if agreed == held >= drafting else drafting


def _in_lockstep(rows: Sequence, moves: dict[int, Move], unsure: set[int]) -> dict[int, Move]:
    """In lockstep the SLM reads every row or none (the rectangle's): a row takes its frontier only where every row
    the SLM would read does; else those rows speculate, but those whose draft ended where the SLM is unsure
    (``unsure``), which wait for the LLM instead (it writes the position: a draft goes no further where it is)."""
    frontier = {r for r, m in moves.items() if m is Move.FRONTIER}
    readers = {r for r, m in moves.items() if m.commits and rows[r].max_new > 1}
    if frontier == readers:
        return moves
    instead = {r: Move.WAITS if r in unsure else Move.SPECULATES for r in frontier}
    return {**moves, **instead}


def plan_block(ledger, policy: WaitPolicy) -> BlockPlan | None:
    """The next ``policy.block`` steps of ``ledger``'s rows (a ``ledger.Ledger``) as one draft block, planned once:
    where each proposing row stands at its start (its depth by the load now, kept for the block's steps) and its end
    tokens; None where a step comes instead: blocks are off, no row proposes, or the LLM may run within the block
    (``_llm_due``: the LLM does not run inside a block)."""
    rows = ledger.proposing()
    if policy.block < 2 or not rows or _llm_due(ledger, policy):
        return None
    drafting, running = set(rows), len(ledger.occupied())
    standing = tuple(Standing.of(row, depth(row, policy, running), policy.draft_cost) if r in drafting else None
                     for r, row in enumerate(ledger.rows))
    ends = tuple(row.ends if r in drafting else frozenset() for r, row in enumerate(ledger.rows))
    return BlockPlan(policy.block, standing, ends, policy.speculate_below, policy.draft_confidence)


def _llm_due(ledger, policy: WaitPolicy) -> bool:
    """Whether the LLM may run within the next ``policy.block`` steps: rows wait or hold pending positions enough
    for it, or the oldest is old enough by then; without speculation, one routed row is enough."""
    rows, step = ledger.rows, ledger.step_no
    since = [row.waiting_since for row in rows if row is not None and row.waiting_since is not None]
    held = [row.pending[0].step for row in rows if row is not None and row.pending]
    # (every row holding pending positions counts, those at threshold 0 too, though the plan counts them once their
    # tail is full: such a row fills it within a block and then waits, and a block would hold the LLM back; the
    # replay at threshold 0 counting them as the plan does: 2.04 against 2.32x the LLM alone at 8 users)
    holders = sum(1 for row in rows if row is not None and (row.waiting_since is not None or row.pending))
    oldest = max((step - s for s in since + held), default=0) + policy.block - 1
    running = len(ledger.occupied())
    if not policy.speculate and (policy.immediate or policy.wanted(running) <= 1):  # one routed row runs the LLM:
        return True  # a block would draft on after it waits, for nothing
    return policy.runs(holders, running, oldest, stalled=False)


@dataclass(frozen=True)
class Outcome:
    """What a step commits (``settle``): the plan as planned, or, where the LLM rejected a pending token, the rows
    cut back there.

    Args:
        llm_writers: rows whose token this step is the LLM's (at their rollback index, or where they waited).
        slm_writers: rows whose token is the SLM's proposal.
        rollbacks: row -> the answer index it is cut back to; its token there is committed anew.
        kept: rows cut back with the others in lockstep whose token at the cut stays what it was.
        resolved: rows whose pending positions are settled (confirmed, or cut away).
        slm_reads: rows the SLM reads the committed token of (those that will propose again).
        agreed: pending positions the LLM confirmed; rejected: those it did not (at most one per row).
        thrown: committed tokens the rollbacks throw away.
        tally: the same per row, (agreed, rejected, thrown), for each row resolved or cut back (a request's counts).
        held: per resolving row, the pending positions the LLM judged (the depth its draft reached).
    """

    llm_writers: tuple[int, ...] = ()
    slm_writers: tuple[int, ...] = ()
    rollbacks: Mapping[int, int] = field(default_factory=dict)
    kept: tuple[int, ...] = ()
    resolved: tuple[int, ...] = ()
    slm_reads: tuple[int, ...] = ()
    agreed: int = 0
    rejected: int = 0
    thrown: int = 0
    tally: Mapping[int, tuple[int, int, int]] = field(default_factory=dict)
    held: Mapping[int, int] = field(default_factory=dict)

    @property
    def writers(self) -> tuple[int, ...]:
        """Rows that commit a token this step."""
        return tuple(sorted(self.slm_writers + self.llm_writers + self.kept))


def settle(rows: Sequence, plan: StepPlan, rejected: Mapping[int, int | None], lockstep: bool = False) -> Outcome:
    """What the step commits given, per resolving row, the position in its pending list of the first token the LLM
    did not confirm (None: it confirmed all; no entry: nothing to resolve). With nothing rejected it is the plan as
    planned; a rejected row is cut back there and the LLM's token committed; in lockstep every row is cut back to
    the earliest such position, where the rejected rows get the LLM's token and the others keep theirs."""
    cut = {r: rows[r].pending[j].index for r, j in rejected.items() if j is not None}
    agreed = {r: len(rows[r].pending) if j is None else j for r, j in rejected.items()}
    held = {r: len(rows[r].pending) for r in plan.resolving}
    if not cut:
        return Outcome(plan.llm_writers, plan.slm_writers, {}, (), plan.resolving, plan.slm_reads,
                       sum(agreed.values()), tally={r: (n, 0, 0) for r, n in agreed.items()}, held=held)
    if lockstep:
        index = min(cut.values())
        occupied = [r for r, row in enumerate(rows) if row is not None and r not in plan.ended]
        llm = tuple(r for r in occupied if cut.get(r) == index)
        kept = tuple(r for r in occupied if r not in llm)
        rollbacks, slm = dict.fromkeys(occupied, index), ()
    else:
        llm = tuple(sorted(set(plan.llm_writers) | set(cut)))
        kept, rollbacks = (), cut
        slm = tuple(r for r in plan.slm_writers if r not in cut)
    writers = sorted(llm + slm + kept)
    left = {r: rows[r].max_new + (rows[r].written - rollbacks[r] if r in rollbacks else 0) for r in writers}
    thrown = {r: rows[r].written - i - (r in kept) for r, i in rollbacks.items()}
    tally = {r: (agreed.get(r, 0), int(r in cut), thrown.get(r, 0)) for r in sorted({*agreed, *thrown})}
    return Outcome(llm, slm, rollbacks, kept, plan.resolving, tuple(r for r in writers if left[r] > 1),
                   sum(agreed.values()), len(cut), sum(thrown.values()), tally, held)
