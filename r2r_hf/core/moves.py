"""A row's move at a step the LLM does not run in: the one rule of who goes on and who waits, on plain values.

At every step each proposing row makes one ``Move``: it writes the SLM's token (it did not route), speculates (it
routed and goes on with the SLM's token, pending), waits for the LLM, or takes its frontier (it speculates with its
last pending token, which the SLM does not read: its next token is the LLM's). ``move`` decides it from where the row
stands (``Standing``) and what its proposal found (routed; the router or the SLM sure). ``plan.plan_step`` decides
every step's moves with it; a draft block (``fast/drafts.py``) decides each drafted step's on the device with its
device form (``drafts.device_move``), and the host applies what the block read back (``Drafted``), so the device's
moves are the plan's. ``tests/test_moves.py`` runs one table of cases through both forms.

A row that routes everywhere may also end a draft where one more token no longer pays for itself (``draft_ends``:
the cost model's expected-gain rule, over the SLM's probabilities of its tail's tokens): it is then as unsure as
where the SLM's probability is under ``draft_confidence``, and its move follows from that.

A draft block is planned once on the host (``BlockPlan``: ``plan.plan_block``), drafted on the device from it, and
read back once (``Drafted``). ``draft_on_host`` drafts the same block over plain values: the cost model's replay
drafts with it, and the tests hold the device's block to it. Nothing here touches a tensor.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import NamedTuple


class Move(enum.Enum):
    """What a proposing row does at a step the LLM does not run in (``move``).

    Each has ``commits`` (it commits a token this step) and ``pending`` (that token is pending: it routed and went on).
    """

    WRITES = ("writes", True, False)  # it did not route: it commits the SLM's token
    SPECULATES = ("speculates", True, True)  # it routed and commits the SLM's token, pending
    WAITS = ("waits", False, False)  # it routed and commits nothing: it waits for the LLM
    FRONTIER = ("frontier", True, True)  # it speculates with its last pending token, unread: it waits for its
    # frontier token

    def __init__(self, word: str, commits: bool, pending: bool) -> None:
        self.commits, self.pending = commits, pending  # (plain attributes: the plan reads them for every row)

    @classmethod
    def of(cls, committed: bool, routed: bool, read: bool) -> Move:
        """The move of a proposing row from a draft block's flags (``drafts.device_move``'s form): whether it
        committed, routed, and the SLM read its token."""
        if not committed:
            return cls.WAITS
        if not routed:
            return cls.WRITES
        return cls.SPECULATES if read else cls.FRONTIER


class Standing(NamedTuple):
    """Where a proposing row stands before a step: what ``move`` reads besides its proposal.

    Args:
        pending: pending positions it holds.
        depth: pending positions it may hold (``plan.depth``).
        left: tokens it may still commit (``ledger.RowState.max_new``).
        everywhere: it routes every position (``RowState.routes``): its next token after a full tail is the LLM's.
        ended: a token of its tail that reached the host ends its answer (``RowState.ended_in_tail``).
        chance: the SLM's probabilities of its pending tokens, multiplied: the chance its draft is confirmed whole.
        expected: 1 + the chance of each prefix of its tail (``chance`` after each token): the tokens its draft is
            expected to give (the LLM's own included).
        cost: an LLM forward's cost in SLM steps where its draft ends by the expected-gain rule (``draft_ends``;
            ``WaitPolicy.draft_cost``); 0: the rule is off.
    """

    pending: int
    depth: int
    left: int
    everywhere: bool
    ended: bool
    chance: float = 1.0
    expected: float = 1.0
    cost: float = 0.0

    @classmethod
    def of(cls, row, depth: int, cost: float = 0.0) -> Standing:
        """A ``ledger.RowState``'s standing, ``depth`` its pending positions at most, ``cost`` the policy's
        ``draft_cost``."""
        chance, expected = 1.0, 1.0
        for p in row.pending if cost > 0 else ():  # (the rule off: no walk of the tail at every step)
            chance *= p.chance  # (in the order a draft block moves them on: its device form gives the same floats)
            expected += chance
        return cls(len(row.pending), depth, row.max_new, bool(row.routes), row.ended_in_tail(), chance, expected,
                   cost)

    def after(self, move: Move, ends: bool, chance: float = 1.0) -> Standing:
        """Where it stands after a step of a draft block in which it made ``move``, the token it committed ending its
        answer where ``ends`` (a tail holding it goes no further: the host sees it at the next step), the SLM's
        probability of that token ``chance``."""
        pending = self.pending + move.pending
        ended = self.ended or (move.commits and pending > 0 and ends)
        standing = self._replace(pending=pending, left=self.left - move.commits, ended=ended)
        if move.pending:
            kept = self.chance * chance
            standing = standing._replace(chance=kept, expected=self.expected + kept)
        return standing


def draft_ends(standing: Standing, chance: float) -> bool:
    """The cost model's expected-gain rule (``benchmarks/speed/depth_rules.py``): a row that routes everywhere ends
    its draft with its proposal, of which the SLM's probability is ``chance``, where drafting one more token no
    longer pays. The tail's probabilities multiplied estimate the chance ``q`` that the draft is confirmed up to
    this token; with it the draft would hold d tokens and cost d SLM steps and an LLM forward (``cost`` SLM steps),
    for the tokens it is expected to give (``expected``, with ``q``): it ends where ``q`` more tokens, the expected
    gain of going on, are worth less than an SLM step at the draft's own rate, ``q * (d + cost) < expected``. No
    history, no floor: it stops early where the SLM doubts and late where it is sure. Device form:
    ``fast/drafts.device_draft_ends``. Replayed on the real pair's traces it is among the best causal rules found
    (docs/lossless.md), with nothing to tune but the cost."""
    s = standing
    if not (s.cost > 0 and s.everywhere):
        return False
    q = s.chance * chance
    return q * (s.pending + 1 + s.cost) < s.expected + q


def move(standing: Standing | None, routed: bool, sure: bool) -> Move:
    """The row's move (see the module docstring): a row that did not route writes (its ``standing`` is not read:
    None will do); a routed row speculates while it may hold one more pending position, the router or the SLM is not
    sure (``sure``: ``speculation.waits``) and no token of its tail ends its answer, else it waits. A row that routes
    everywhere, with a token left after this one, takes its frontier where it fills its depth, or where the SLM is
    unsure: its draft ends with that token, which the LLM judges with the rest in the forward that would have written
    the position (as an assisted generation's draft ends with its unsure token), rather than waiting for the LLM to
    write it. Its device form: ``fast/drafts.device_move``."""
    s = standing
    if not routed:
        return Move.WRITES
    if s.pending >= s.depth or s.ended:
        return Move.WAITS
    if s.everywhere and s.left > 1 and (sure or s.pending + 1 >= s.depth):
        return Move.FRONTIER
    return Move.WAITS if sure else Move.SPECULATES


@dataclass(frozen=True)
class BlockPlan:
    """A draft block as the host plans it, once, before it (``plan.plan_block``): the device drafts from it.

    Args:
        steps: steps it drafts (``WaitPolicy.block``).
        standing: per slot, where each drafting row stands at its start (its depth kept for the block's steps: the
            depth by the load at its start); None: the slot does not draft.
        ends: per slot, the tokens that end its answer (``RowState.ends``).
        below, confidence: the policy's bounds on where a routed row is sure (``WaitPolicy.speculate_below``,
            ``draft_confidence``).
    """

    steps: int
    standing: tuple[Standing | None, ...]
    ends: tuple[frozenset[int], ...]
    below: float = math.inf
    confidence: float = 0.0

    @property
    def rows(self) -> tuple[int, ...]:
        """The rows that draft (those that propose at its start)."""
        return tuple(r for r, s in enumerate(self.standing) if s is not None)


@dataclass(frozen=True)
class Drafted:
    """What a draft block read back in its one synchronisation (``fast/drafts.read_back``), or drafted on the host
    (``draft_on_host``): per drafted step, per slot, the SLM's argmax proposal, whether it routed and whether it was
    sure (the router, or where its draft ended); each proposing row's move; the token each slot committed at the
    step before the block (-1: none); and per drafted step, per slot, the SLM's probability of its proposal (as the
    host reads it back: ``staging.in_units``)."""

    previous: list[int]
    token: list[list[int]]
    routed: list[list[bool]]
    sure: list[list[bool]]
    moves: list[dict[int, Move]]
    chance: list[list[float]]

    def chances(self, i: int) -> dict[int, float]:
        """Drafted step ``i``'s probabilities of each proposing row's token (``Pending.chance``)."""
        return {r: self.chance[i][r] for r in self.moves[i]}

    @property
    def committed(self) -> list[list[bool]]:
        """Per drafted step, per slot: whether it committed a token."""
        return [[r in step and step[r].commits for r in range(len(self.previous))] for step in self.moves]

    @property
    def read(self) -> list[list[bool]]:
        """Per drafted step, per slot: whether the SLM read the token it committed (not a frontier's)."""
        return [[r in step and step[r].commits and step[r] is not Move.FRONTIER for r in range(len(self.previous))]
                for step in self.moves]

    def arrived(self, i: int) -> list[int]:
        """The tokens that reach the host at drafted step ``i`` (those committed at the step before it)."""
        if i == 0:
            return self.previous
        step = self.moves[i - 1]
        return [t if r in step and step[r].commits else -1 for r, t in enumerate(self.token[i - 1])]


def draft_on_host(plan: BlockPlan, previous: Sequence[int],
                  propose: Callable[[int, int], tuple[int, bool, bool, float]]) -> Drafted:
    """``plan``'s block drafted on the host as the device drafts it (``fast/drafts.draft_fn``), ``propose(row,
    tokens it committed in the block)`` -> (token, routed, sure, the SLM's probability of the token as the host reads
    it: ``staging.in_units``) standing for the SLM's argmax and the router: each step every drafting row makes its
    ``move`` (sure also where its draft ends: ``draft_ends``) and stands ``after`` it; a row drafts on while the SLM
    reads its token and it has tokens left. ``previous``: each slot's token committed before the block (-1: none)."""
    slots = len(plan.standing)
    standing = {r: s._replace(ended=s.ended or (s.pending > 0 and previous[r] in plan.ends[r]))
                for r, s in enumerate(plan.standing) if s is not None}
    token, routed, sure, moves, chances = [], [], [], [], []
    for _ in range(plan.steps):
        step = ([0] * slots, [False] * slots, [False] * slots, {}, [0.0] * slots)
        for r, s in list(standing.items()):
            t, hit, certain, chance = propose(r, plan.standing[r].left - s.left)
            certain = certain or (hit and draft_ends(s, chance))
            m = move(s, hit, certain)
            step[0][r], step[1][r], step[2][r], step[3][r], step[4][r] = t, hit, certain, m, chance
            standing[r] = s.after(m, t in plan.ends[r], chance)
            if not m.commits or m is Move.FRONTIER or standing[r].left <= 0:
                del standing[r]
        for part, value in zip((token, routed, sure, moves, chances), step):
            part.append(value)
    return Drafted(list(previous), token, routed, sure, moves, chances)
