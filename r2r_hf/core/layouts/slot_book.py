"""Where each slot's row stands, in host values: its committed length, how far each model has read it, and the
forwards a read of several rows takes.

``SlotLayout`` keeps one beside its device buffers and runs the forwards it plans; the cost model's replay
(``benchmarks/serving/cost_model.py``) keeps one and prices the same forwards, so both read the same shapes.
"""

from __future__ import annotations

import itertools

from .packed import GROUPS

# Tokens per row one slot forward reads at most: a long prompt is read in pieces of this many (the
# attention scores of one piece stay small, and a long read is several short forwards).
PIECE = 256

ROLES = ("slm", "llm")


class SlotBook:
    """Per slot: committed tokens (prompt included) and, per model, how many of them it has read.

    Args:
        slots: rows at most (``grow`` adds more).
    """

    def __init__(self, slots: int) -> None:
        self.length = [0] * slots
        self.prompt = [0] * slots
        self.seen = {role: [0] * slots for role in ROLES}
        # where each model's checkpoint of a row's recurrent state stands (``slot_state.py``; None: none kept)
        self.saved: dict[str, list[int | None]] = {role: [None] * slots for role in ROLES}
        self.riders: tuple[list[int], int | None] = ([], None)  # prompt pieces the LLM's next packed read takes

    def grow(self, slots: int) -> None:
        extra = [0] * (slots - len(self.length))
        self.length += extra
        self.prompt += extra
        for role in ROLES:
            self.seen[role] += extra
            self.saved[role] += [None] * len(extra)

    def place(self, row: int, tokens: int) -> None:
        """Slot ``row`` holds a new prompt of ``tokens`` tokens; no model has read it."""
        self.length[row] = self.prompt[row] = tokens
        for role in ROLES:
            self.seen[role][row], self.saved[role][row] = 0, None

    def cut(self, row: int, index: int) -> list[str]:
        """Row ``row`` back to its prompt and first ``index`` answer tokens; neither model has read past them. The
        models that had read past them (a recurrent state then goes back to its checkpoint: ``restore``)."""
        self.length[row] = self.prompt[row] + index
        past = [role for role in ROLES if self.seen[role][row] > self.length[row]]
        for role in past:
            self.seen[role][row] = self.length[row]
        return past

    def keep(self, role: str, rows: list[int]) -> None:
        """``role``'s state of each of ``rows`` is checkpointed where the model has read the row to."""
        for r in rows:
            self.saved[role][r] = self.seen[role][r]

    def restore(self, role: str, row: int) -> None:
        """``role``'s state of ``row`` is back at its checkpoint: the model reads the row again from there."""
        saved = self.saved[role][row]
        if saved is None or saved > self.length[row]:
            raise RuntimeError(f"slot {row}'s {role.upper()} state was cut back to {self.length[row]} tokens without a "
                               f"checkpoint at or before them ({saved})")
        self.seen[role][row] = saved

    def free(self, row: int) -> None:
        self.place(row, 0)

    def unread(self, role: str, row: int) -> int:
        return self.length[row] - self.seen[role][row]

    def read(self, role: str, rows: list[int], limit: int | None = None, short: int = 0,
             piece: int = PIECE, upto: dict[int, int] | None = None, widths: tuple[int, ...] | None = None,
             stepwise: bool = False) -> list[list[tuple[int, int, int]]]:
        """``role`` reads each row's unread tokens but the last ``short`` (or up to column ``upto[row]``; at most
        ``limit`` of them), ``piece`` at a time: the forwards this takes, each a list of (row, first column, tokens)
        over the rows it reads. The tokens count as read once planned (the caller runs every forward).

        With ``widths`` (a model with recurrent layers: ``slot_state.py``), every row of a forward reads the same
        number of tokens, one of ``widths``: the widest that fits the most any row has left, taken by each row with
        that many left (the others read in later forwards); ``stepwise`` (a model whose forward over several tokens
        does not continue its state: ``Abilities.continues``), a row the model has read reads one token a forward."""
        seen = self.seen[role]
        left = {r: (self.length[r] - short if upto is None else upto[r]) - seen[r] for r in rows}
        if any(n < 1 for n in left.values()):
            raise ValueError("a row is read only when it holds a token the model has not read")
        if limit is not None:
            left = {r: min(n, limit) for r, n in left.items()}
        forwards = []
        while left:
            if widths is None:
                forward = [(r, seen[r], min(left[r], piece)) for r in rows if r in left]
            else:
                can = {r: min(n, 1 if stepwise and seen[r] else piece) for r, n in left.items()}
                width = max(w for w in widths if w <= max(can.values()))
                forward = [(r, seen[r], width) for r in rows if can.get(r, 0) >= width]
            for r, _, n in forward:
                seen[r] += n
                left[r] -= n
                if not left[r]:
                    del left[r]
            forwards.append(forward)
        return forwards

    # ------------------------------------------------------------ the LLM's packed reads (``packed.py``)
    def ride(self, rows: list[int], limit: int | None) -> list[list[tuple[int, int, int]]]:
        """A prefill turn's LLM pieces (at most ``limit`` tokens of each of ``rows``, of all but its last prompt token:
        the row's first catch-up reads that one, and its logits there are the LLM's first token) ride in the LLM's
        next packed read; the forwards of the previous turn's pieces that no read took, to read now."""
        left = self.packed([], None, 0)
        self.riders = (rows, limit)
        return left

    def packed(self, rows: list[int], limit: int | None, short: int,
               upto: dict[int, int] | None = None) -> list[list[tuple[int, int, int]]]:
        """The LLM's packed forwards reading ``rows`` (``read``, at most ``GROUPS[-1]`` tokens of a row in each), the
        riders merged in (a rider that ``rows`` read in full is not read twice)."""
        forwards = self.read("llm", rows, limit, short, GROUPS[-1], upto) if rows else []
        riding, most = self.riders
        # (a rider reads its prompt only: by now it may have answer tokens, which its catch-up reads)
        ends = {r: self.prompt[r] - 1 for r in riding if r not in rows and self.prompt[r] - 1 > self.seen["llm"][r]}
        self.riders = ([], None)
        extra = self.read("llm", sorted(ends), most, 0, GROUPS[-1], ends) if ends else []
        return [a + b for a, b in itertools.zip_longest(forwards, extra, fillvalue=[])]
