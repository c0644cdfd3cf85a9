"""How a slot layout's models read their rows: one value per model, chosen once when the slots are built (``SlotPath``).

A read brings a model up to date with some rows: each row's tokens it has not read (a prompt's piece, the SLM's one
token after a step, the LLM's catch-up), or, for a speculative resolution, through a row's pending positions with
the logits at each (``predict``). ``SlotBook`` says which tokens each read takes; a ``Reads`` says how they are laid
out into forwards and run:

* ``PaddedReads``  each forward a [rows x widest] piece, right-aligned (``slot_cache.piece``), run eagerly
                   (``eager_forward``: HF's forward over the slot cache) or as a captured replay of its shape bucket
                   (``fast/slot_reads.PaddedSteps``);
* ``PackedReads``  the LLM's forwards as one flat list of the rows' tokens (``packed.py``), fused and captured
                   (``fast/packed_reads.PackedSteps``); a prompt's pieces ride in its next read (``SlotBook.ride``).

The layout holds one ``SlotPath`` — both models' reads, the router, the draft blocks — eager when built, captured once
``fast/slot_reads.capture_slots`` hands it the captured one; it never asks which kind it holds.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from .packed import pack
from .slot_book import PIECE
from .slot_cache import SlotCache, read_piece

# One padded forward: (tokens [S, C], rows, starts, counts, every) -> (logits, hidden or None, folded scores or None)
Forward = Callable[..., tuple]


class Reads(Protocol):
    """How one model reads slots (see the module docstring). ``layout`` is the ``SlotLayout`` (its book, tokens and
    counters); ``role`` "slm" or "llm"."""

    def read(self, layout, role: str, rows: list[int], limit: int | None = None,
             short: int = 0) -> tuple[list[int], Any, Any, Any]:
        """``role`` reads each row's unread tokens but the last ``short`` (at most ``limit``): the rows read to their
        end, with the logits [k, V], the hidden states [k, H] (the SLM's; else None) and the folded router scores [k]
        (else None) after their last token."""

    def predict(self, layout, needs: dict[int, list[int]]) -> dict[int, tuple[list[int], torch.Tensor]]:
        """The LLM reads each row through the token before its last needed answer index; per row, the indices
        ``needs[row]`` and the logits [n, V] predicting each."""

    def prefill(self, layout, rows: list[int], limit: int | None) -> None:
        """The LLM's part of a prefill turn: at most ``limit`` tokens of each row's prompt but its last."""


class PaddedReads:
    """A model's reads in padded pieces of at most ``piece`` tokens per row, each run by ``forward`` on ``cache``;
    ``computed(rows, counts)``: the token-rows one forward computes (its rectangle, or its captured bucket);
    ``widths``: for a model with recurrent layers, the widths a forward may take, every row reading as many tokens
    (no row padded: ``slot_state.py``), else None; ``stepwise``: past its first read a row reads one token a forward
    (``Abilities.continues``)."""

    def __init__(self, forward: Forward, piece: int, cache: SlotCache,
                 computed: Callable[[list[int], list[int]], int] | None = None, steps: Any = None,
                 widths: tuple[int, ...] | None = None, stepwise: bool = False) -> None:
        self.forward, self.piece, self.cache, self.widths, self.stepwise = forward, piece, cache, widths, stepwise
        self.computed = computed or (lambda rows, counts: len(rows) * max(counts))
        self.steps = steps  # the captured steps it replays (None: eager)

    def read(self, layout, role: str, rows: list[int], limit: int | None = None, short: int = 0):
        forwards = layout.book.read(role, rows, limit, short, self.piece, widths=self.widths, stepwise=self.stepwise)
        outputs: dict[int, tuple] = {}
        before = self.cache.gathered_bytes
        for forward in forwards:
            who, starts, counts = (list(column) for column in zip(*forward))
            out = self.forward(layout.tokens, who, starts, counts)
            layout.counters.forward(role, len(who), max(counts), sum(counts), self.computed(who, counts))
            for j, (r, start, n) in enumerate(forward):
                if start + n == layout.book.length[r]:  # read to its end: its next-token outputs
                    outputs[r] = tuple(None if value is None else value[j] for value in out)
        layout.counters.gathered_bytes += self.cache.gathered_bytes - before
        done = [r for r in rows if r in outputs]
        if not done:
            return [], None, None, None
        if len(forwards) == 1 and who == done:  # one forward read every row to its end, in order: its outputs
            return (done, *out)
        return (done, *(None if out[i] is None else torch.stack([outputs[r][i] for r in done]) for i in range(3)))

    def predict(self, layout, needs: dict[int, list[int]]) -> dict[int, tuple[list[int], torch.Tensor]]:
        book, rows = layout.book, sorted(needs)
        ends, got = {r: book.prompt[r] + max(needs[r]) for r in rows}, {r: {} for r in rows}
        for forward in book.read("llm", rows, upto=ends, piece=self.piece, widths=self.widths, stepwise=self.stepwise):
            who, starts, counts = (list(column) for column in zip(*forward))
            logits = self.forward(layout.tokens, who, starts, counts, every=True)[0]
            layout.counters.forward("llm", len(who), max(counts), sum(counts), self.computed(who, counts))
            for j, (r, start, n) in enumerate(forward):  # token column c sits at piece column width - n + c - start
                for c in range(start, start + n):
                    got[r][c + 1] = logits[j, logits.shape[1] - n + c - start]
        return {r: (needs[r], torch.stack([got[r][book.prompt[r] + i] for i in needs[r]])) for r in rows}

    def prefill(self, layout, rows: list[int], limit: int | None) -> None:
        rows = [r for r in rows if layout.book.unread("llm", r) > 1]
        if rows:
            self.read(layout, "llm", rows, limit, short=1)


def eager_forward(model: torch.nn.Module, cache: SlotCache, hidden: bool) -> Forward:
    """One padded forward of HF's model over the slot cache, eagerly (``slot_cache.read_piece``)."""

    def forward(tokens, rows, starts, counts, every=False):
        if every:
            return read_piece(model, cache, tokens, rows, starts, counts, every=True)[0], None, None
        return (*read_piece(model, cache, tokens, rows, starts, counts, hidden=hidden), None)

    return forward


class PackedReads:
    """The LLM's packed reads (``packed.py``): one flat forward per piece of at most ``GROUPS[-1]`` tokens per row,
    run by ``steps`` (``fast/packed_reads.PackedSteps``: ``read(tokens, plan)`` -> the kept logits; ``kept``: how many
    logits a read returns, by whether it resolves pending positions)."""

    def __init__(self, steps: Any) -> None:
        self.steps = steps

    def read(self, layout, role: str, rows: list[int], limit: int | None = None, short: int = 0):
        outputs, book = {}, layout.book
        for forward in book.packed(rows, limit, short):
            keep = [(r, start + n - 1) for r, start, n in forward if start + n == book.length[r]]
            for (r, _), logits in zip(keep, self._run(layout, forward, keep, self.steps.kept[False])):
                outputs[r] = logits
        done = [r for r in rows if r in outputs]
        return (done, torch.stack([outputs[r] for r in done]), None, None) if done else ([], None, None, None)

    def predict(self, layout, needs: dict[int, list[int]]) -> dict[int, tuple[list[int], torch.Tensor]]:
        """(the logits where they are needed only: the column before each needed index)"""
        book, rows = layout.book, sorted(needs)
        ends, got = {r: book.prompt[r] + max(needs[r]) for r in rows}, {r: {} for r in rows}
        wanted = {r: [book.prompt[r] + i - 1 for i in needs[r]] for r in rows}  # the column predicting each
        for forward in book.packed(rows, None, 0, ends):
            keep = [(r, c) for r, start, n in forward for c in wanted.get(r, ()) if start <= c < start + n]
            for (r, c), logits in zip(keep, self._run(layout, forward, keep, self.steps.kept[True])):
                got[r][c + 1] = logits
        return {r: (needs[r], torch.stack([got[r][book.prompt[r] + i] for i in needs[r]])) for r in rows}

    def prefill(self, layout, rows: list[int], limit: int | None) -> None:
        """(the LLM reads its pieces inside its next packed read: ``SlotBook.ride``)"""
        rows = [r for r in rows if layout.book.unread("llm", r) > 1]
        for forward in layout.book.ride(rows, limit):
            self._run(layout, forward, [], self.steps.kept[False])

    def _run(self, layout, forward: list[tuple[int, int, int]], keep: list[tuple[int, int]],
             kept: int) -> torch.Tensor:
        """One packed read of ``forward``'s (row, first column, tokens); the logits after each of ``keep``."""
        who, starts, counts = (list(column) for column in zip(*forward))
        plan = pack(who, starts, counts, keep, kept)
        layout.counters.forward("llm", len(who), max(counts), real=plan.real, read=plan.width)
        return self.steps.read(layout.tokens, plan)


@dataclass(frozen=True)
class SlotPath:
    """Everything a slot layout runs its reads with, chosen once (see the module docstring).

    Args:
        slm, llm: each model's ``Reads``.
        route: the router on the SLM's proposals: (logits [k, V], hidden [k, H], token [k]) -> scores [k].
        drafts: draft blocks (``fast/drafts.CapturedDrafts``), or None: the layout does not draft.
        static: the reads were captured over the layout's buffers, which never move from now on.
    """

    slm: Reads
    llm: Reads
    route: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
    drafts: Any = None
    static: bool = False


def eager_path(pair, slm_cache: SlotCache, llm_cache: SlotCache, route: Callable) -> SlotPath:
    """The path a slot layout starts on: both models' HF forwards over the slot caches, eagerly, in pieces of
    ``PIECE`` tokens (of any width, alike in a forward, for a model with recurrent layers); the router as ``route``."""
    def reads(model, cache, hidden, able):
        uniform = "recurrent" in able.kinds or able.continues is not None
        widths = tuple(range(1, PIECE + 1)) if uniform else None
        return PaddedReads(eager_forward(model, cache, hidden), PIECE, cache, widths=widths,
                           stepwise=able.continues is not None)

    return SlotPath(reads(pair.slm, slm_cache, True, pair.abilities.slm),
                    reads(pair.llm, llm_cache, False, pair.abilities.llm), route)
