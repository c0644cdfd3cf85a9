"""One answer (a row of the running batch): what it asked for, its text so far, when it stops.

A ``Choice`` is one answer a request asks for: its settings, resolved as ``generate`` resolves a call's
(``model/row_settings.py``: the same precedence, the same HF processors, the same checks), and its stop
strings. ``Row`` is the answer being written: it decodes the tokens the decoding thread hands it, holds
back text that could be the start of a stop string, and says why it ended. ``Delivery`` is the server's stop
rule for one step (``core.turn.Stops``): it hands each row the token that reached the host and keeps, in order,
what the clients are to be told once the step has run.

Between the step's synchronisation and its device work only the decision runs: whether a token ends its answer
(EOS, the length limit, a stop string). A row without stop strings decides from the token alone; its text is
decoded once the step's device work is queued (``Row.piece``, from the engine's delivery), so on a GPU it overlaps
the device's work instead of delaying it. A row with stop strings decodes at once (its text decides).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from ..model.row_settings import RowSettings
from ..views.text import IncrementalText


@dataclass(frozen=True)
class Choice:
    """One answer of a request.

    Args:
        settings: its resolved decoding settings.
        stops: strings that end the answer (not included in it).
    """

    settings: RowSettings
    stops: tuple[str, ...] = ()

    @property
    def max_tokens(self) -> int:
        return self.settings.max_new_tokens

    @property
    def min_tokens(self) -> int:
        """Tokens written before anything may end the answer: HF's ``min_new_tokens`` holds the EOS back, and (as in
        vLLM) a stop string counts only where it ends in text written from that token on."""
        return int(self.settings.generation_config.min_new_tokens or 0)


class Row:
    """One answer being written: its text as it grows, what may be sent yet, and why it ended.

    Text that could be the start of a stop string is held back until it is not (or the answer ends).

    Args:
        owner: the request the row answers (``index`` is its choice's index there).
        choice: what it asked for.
        tokenizer: decodes its tokens.
    """

    def __init__(self, owner, index: int, choice: Choice, tokenizer) -> None:
        self.owner, self.index, self.choice = owner, index, choice
        self.eos_ids = choice.settings.eos_ids
        self.text = IncrementalText(tokenizer)
        self.sent = 0  # characters of text already handed out
        self.floor = 0  # characters written before the first token that may end the answer (``Choice.min_tokens``)
        self.generated = self.llm_tokens = 0
        self.routed: list[bool] = []  # who wrote each token (the LLM: True), for traces
        self.finish: str | None = None
        self.speculated = None  # what speculation did for it (its slot's ``core.ledger.Speculated``: engine.py)
        self.due: list[str | tuple[int, bool]] = []  # per token taken, its text or (token, last) to decode later

    @property
    def seed(self) -> int | None:
        """The answer's seed (None: none given): a router that draws per row keys its draws with it."""
        return self.choice.settings.seed

    def add(self, token: int, routed: bool, last: bool = False) -> str:
        """Take the row's next token (``last``: the length limit allows no more); returns the text that may be sent
        now (possibly empty)."""
        self.take(token, routed, last)
        return self.piece()

    def take(self, token: int, routed: bool, last: bool = False) -> None:
        """Take the row's next token: ``finish`` says at once whether it ended the answer; its text comes from
        ``piece`` (decoded now where a stop string could end the answer, else when ``piece`` asks)."""
        self.generated += 1
        self.llm_tokens += int(routed)
        self.routed.append(routed)
        if self.choice.stops:
            self.due.append(self._text(token, last))
        else:  # the token alone decides, as ``_text`` will
            self.finish = "stop" if token in self.eos_ids else "length" if last else self.finish
            self.due.append((token, last))

    def piece(self) -> str:
        """The text the oldest token taken and not yet handed out lets the row send (possibly empty)."""
        due = self.due.pop(0)
        return due if isinstance(due, str) else self._text(*due)

    def _text(self, token: int, last: bool) -> str:
        ends = token in self.eos_ids
        if not ends:
            if self.generated == self.choice.min_tokens:
                self.floor = len(self._full())
            self.text.add(token)
        # Once the answer ends, its text is the decode of all its tokens, what the window held back included.
        full = self.text.text + self.text.end() if ends or last else self._full()
        stop_at = self._stop_position(full) if self.generated >= self.choice.min_tokens else None
        if stop_at is not None or ends or last:
            self.finish = "stop" if stop_at is not None or ends else "length"
            return self._release(full, len(full) if stop_at is None else stop_at)
        # (before the end only text no later token changes is sent: ``IncrementalText.tail`` may change)
        return self._release(full, min(len(self.text.text), len(full) - self._held(full)))

    def _full(self) -> str:
        """The answer's text so far: what is decoded for good, and the end a later token may still change."""
        return self.text.text + self.text.tail if self.text.tail else self.text.text

    def _stop_position(self, full: str) -> int | None:
        longest = max((len(s) for s in self.choice.stops), default=0)
        found = [full.find(s, max(0, self.sent - longest, self.floor - len(s) + 1)) for s in self.choice.stops]
        found = [i for i in found if i >= 0]
        return min(found) if found else None

    def _held(self, full: str) -> int:
        """Characters at the end of ``full`` (not yet sent) that begin some stop string."""
        tail = full[self.sent:]
        return max((n for s in self.choice.stops for n in range(min(len(s) - 1, len(tail)), 0, -1)
                    if s.startswith(tail[-n:])), default=0)

    def _release(self, full: str, upto: int) -> str:
        piece = full[self.sent : max(upto, self.sent)]
        self.sent = max(upto, self.sent)
        return piece


@dataclass
class Delivery:
    """One step's stop rule for the server's rows (``core.turn.Stops``; see the module docstring).

    Args:
        batch: the running batch (each slot's ``RowState.owner`` is its ``Row``).
        texts: (row, when, whether it ended the answer) for every token that reached its row, in order (after
            speculation several tokens of one row reach it in one step); each one's text is the row's next ``piece``.
        failed: rows whose draw failed (their request gets an error).
    """

    batch: object
    texts: list[tuple[Row, float, bool]] = field(default_factory=list)
    failed: list[Row] = field(default_factory=list)

    def reads(self) -> tuple:
        return ()

    def ended(self, synced) -> dict[int, int]:
        now, ended = time.monotonic(), {}
        for r, state in enumerate(self.batch.ledger.rows):
            for taken, (token, by_llm, last) in enumerate([] if state is None else synced.delivered[r], 1):
                row: Row = state.owner
                row.take(token, by_llm, last=last)
                self.texts.append((row, now, row.finish is not None))
                if row.finish is not None:
                    ended[r] = taken
                    break
        self.failed = [self.batch.ledger.rows[r].owner for r in sorted(synced.failed - set(ended))]
        return ended
