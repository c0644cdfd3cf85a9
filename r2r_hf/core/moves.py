"""A row's move at a step the LLM does not run in: the one rule of who goes on and who waits, on plain values.

At every step each proposing row makes one ``Move``: it writes the SLM's token (it did not route), speculates (it
routed and goes on with the SLM's token, pending), waits for the LLM, or takes its frontier (it speculates with its
last pending token, which the SLM does not read: its next token is the LLM's). ``move`` decides it from where the row
stands (``Standing``) and what its proposal found (routed; the router or the SLM sure). ``plan.plan_step`` decides
every step's moves with it; a draft block (``fast/drafts.py``) decides each drafted step's on the device with its
device form (``drafts.device_move``). ``tests/test_moves.py`` runs one table of cases through both forms.

Nothing here touches a tensor.
"""

from __future__ import annotations

import enum
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
    """

    pending: int
    depth: int
    left: int
    everywhere: bool
    ended: bool

    @classmethod
    def of(cls, row, depth: int) -> Standing:
        """A ``ledger.RowState``'s standing, ``depth`` its pending positions at most."""
        return cls(len(row.pending), depth, row.max_new, bool(row.routes), row.ended_in_tail())


def move(standing: Standing | None, routed: bool, sure: bool) -> Move:
    """The row's move (see the module docstring): a row that did not route writes (its ``standing`` is not read:
    None will do); a routed row speculates while it may hold one more pending position, the router or the SLM is not
    sure (``sure``: ``speculation.waits``) and no token of its tail ends its answer, else it waits; a speculating row
    that routes everywhere and fills its depth with a token left after this one takes its frontier. Its device form:
    ``fast/drafts.device_move``."""
    s = standing
    if not routed:
        return Move.WRITES
    if s.pending >= s.depth or sure or s.ended:
        return Move.WAITS
    if s.everywhere and s.pending + 1 >= s.depth and s.left > 1:
        return Move.FRONTIER
    return Move.SPECULATES
