"""The server's layout: one slot per row, each row at its own length (``slot_cache.py`` holds the KV).

Rows join free slots, leave them and wait for the LLM independently: the LLM reads only the rows asked for, each
from where it last stopped, and a long prompt is read in chunks between the others' steps (``prefill``). The
slots grow (amortised doubling) until the fast path captures them (``capture``: static from then on,
``fast/slot_reads.py``)."""

from __future__ import annotations

import torch

from ..counters import Counters
from ..features import input_device
from ..moves import BlockPlan
from ..pair import RoutedPair
from .model_calls import route_scores
from .packed import pack
from .slot_book import PIECE, SlotBook
from .slot_cache import SlotCache, read_piece
from ..staging import staged

class SlotLayout:
    """One slot per row, each at its own length (see the module docstring and ``slot_cache.py``).

    Args:
        pair: the models and the router.
        slots: rows at most.
        capacity: columns per row to start with (``reserve`` grows it).
        counters: where forwards, joins and copies are counted.
    """

    lockstep = False

    def __init__(self, pair: RoutedPair, slots: int, capacity: int, counters: Counters) -> None:
        self.pair, self.counters = pair, counters
        self.device = input_device(pair.slm)
        self.tokens = torch.zeros(slots, capacity, dtype=torch.long, device=self.device)
        self.slm_cache = SlotCache(pair.slm.config.num_hidden_layers, slots, capacity)
        self.llm_cache = SlotCache(pair.llm.config.num_hidden_layers, slots, capacity)
        self.book = SlotBook(slots)  # each row's length and how far each model has read it
        # Once the fast path captured the slots (``fast/slot_reads.capture_slots``): each model's captured reads and the
        # captured router; the slots are static from then on.
        self.captured: dict | None = None
        self.router_step = None

    @property
    def slots(self) -> int:
        return self.tokens.shape[0]

    @property
    def capacity(self) -> int:
        return self.tokens.shape[1]

    def reserve(self, slots: int, columns: int) -> int:
        """Room for ``slots`` rows of ``columns`` tokens; the KV bytes copied to make it (0 when it fits)."""
        slots, columns = max(slots, self.slots), max(columns, self.capacity)
        if (slots, columns) == (self.slots, self.capacity):
            return 0
        if self.captured is not None:  # captured steps point at these buffers: they never move
            raise ValueError(f"An answer needs {columns} tokens of context; this server's static slots hold "
                             f"{self.capacity} (max_context; --max-context on the command line). Shorten the prompt or "
                             "max_tokens.")
        columns = max(columns, 2 * self.capacity) if columns > self.capacity else columns  # amortised growth
        tokens = self.tokens.new_zeros(slots, columns)
        tokens[: self.slots, : self.capacity] = self.tokens
        self.tokens = tokens
        self.book.grow(slots)
        return self.slm_cache.grow(slots, columns) + self.llm_cache.grow(slots, columns)

    def place(self, row: int, prompt: list[int]) -> None:
        """A new answer's prompt in slot ``row`` (which must have room: ``reserve``); neither model read it yet."""
        self.tokens[row, : len(prompt)] = torch.tensor(prompt, dtype=torch.long, device=self.device)
        self.book.place(row, len(prompt))

    def free(self, row: int) -> None:
        self.book.free(row)

    def row_ids(self, row: int, index: int | None = None) -> torch.Tensor:
        """[1, L] the committed tokens of one row (what its processors see, as they would alone); with ``index``,
        its prompt and first ``index`` answer tokens only."""
        end = self.book.length[row] if index is None else self.book.prompt[row] + index
        return self.tokens[row : row + 1, :end]

    def tokens_at(self, row: int, indices: list[int]) -> torch.Tensor:
        """[n] the row's committed answer tokens at ``indices``."""
        return self.tokens[row, staged([self.book.prompt[row] + i for i in indices], self.device)]

    def cut(self, row: int, index: int) -> None:
        """The row back to its first ``index`` answer tokens: what follows is written over (no cache is moved)."""
        self.book.cut(row, index)

    def predict(self, needs: dict[int, list[int]]) -> dict[int, tuple[list[int], torch.Tensor]]:
        """The LLM reads each row through the token before its last needed answer index; per row, the indices
        ``needs[row]`` and the logits [n, V] predicting each."""
        book, ends = self.book, {r: self.book.prompt[r] + max(indices) for r, indices in needs.items()}
        rows, got = sorted(needs), {r: {} for r in needs}
        captured = None if self.captured is None else self.captured["llm"]
        if getattr(captured, "packed", False):  # the logits where they are needed only (``packed.py``)
            wanted = {r: [book.prompt[r] + i - 1 for i in needs[r]] for r in rows}  # the column predicting each
            for forward in book.packed(rows, None, 0, ends):
                keep = [(r, c) for r, start, n in forward for c in wanted.get(r, ()) if start <= c < start + n]
                logits = self._packed(captured, forward, keep, kept=captured.kept[True])
                for (r, c), row in zip(keep, logits):
                    got[r][c + 1] = row
            return {r: (needs[r], torch.stack([got[r][book.prompt[r] + i] for i in needs[r]])) for r in rows}
        for forward in book.read("llm", rows, upto=ends, piece=PIECE if captured is None else captured.piece):
            who, starts, counts = (list(column) for column in zip(*forward))
            if captured is None:
                logits = read_piece(self.pair.llm, self.llm_cache, self.tokens, who, starts, counts, every=True)[0]
            else:
                logits = captured.read(self.tokens, who, starts, counts, every=True)[0]
            self.counters.forward("llm", len(who), max(counts), sum(counts), self._computed(captured, who, counts))
            for j, (r, start, n) in enumerate(forward):  # token column c sits at piece column width - n + c - start
                for c in range(start, start + n):
                    got[r][c + 1] = logits[j, logits.shape[1] - n + c - start]
        return {r: (needs[r], torch.stack([got[r][book.prompt[r] + i] for i in needs[r]])) for r in rows}

    def append(self, rows: list[int], token: torch.Tensor, running: torch.Tensor | None = None) -> torch.Tensor:
        """Commit ``token[r]`` [S] to each row of ``rows`` (each at its own length); ``token``."""
        if rows:
            at = staged([rows, [self.book.length[r] for r in rows]], self.device)  # one copy, the host goes on
            token = token.to(self.device)
            if len(rows) == self.slots:  # every slot writes: no gather of the tokens
                self.tokens.scatter_(1, at[1][:, None], token[:, None])
            else:
                self.tokens.index_put_((at[0], at[1]), token.index_select(0, at[0]))
            for r in rows:
                self.book.length[r] += 1
        return token

    def slm_read(self, rows: list[int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """[k, V] logits and [k, H] hidden states of the SLM after each row's last committed token, and the router's
        scores [k] of each row's argmax proposal where the router is folded into the SLM's reads (else None)."""
        return self._read("slm", rows)[1:]

    def llm_read(self, rows: list[int]) -> torch.Tensor:
        """[k, V] logits of the LLM after each row's last committed token (it reads what it has not)."""
        return self._read("llm", rows)[1]

    def prefill(self, rows: list[int], limit: int | None) -> tuple:
        """Both models read at most ``limit`` more prompt tokens of each row (a long prompt is read over several
        turns, between the others' steps); the rows whose prompt is now read, with the SLM's outputs after it
        (``slm_read``'s). The LLM reads the prompt here too, all but its last token (its first catch-up reads at
        least that one, and its logits there are the LLM's first token), so that catch-up is short."""
        llm_rows = [r for r in rows if self.book.unread("llm", r) > 1]
        if self._packs():  # the LLM reads its pieces inside its next packed read (``SlotBook.ride``)
            reads = self.captured["llm"]
            for forward in self.book.ride(llm_rows, limit):
                self._packed(reads, forward, [], reads.kept[False])
        elif llm_rows:
            self._read("llm", llm_rows, limit, short=1)
        return self._read("slm", rows, limit)

    def draft(self, plan: BlockPlan, **outputs: torch.Tensor) -> tuple:
        """``plan``'s draft block (``fast/drafts.py``) of every slot from each slot's SLM outputs, threshold and last
        token (``outputs``), read back once: what it drafted (``moves.Drafted``) and each slot's SLM outputs after
        it (device values). The block writes the drafted tokens and the SLM's cache; the book counts them
        (``drafted``)."""
        drafted, outputs = self.captured["drafts"].run(plan, self.book.length, **outputs)
        self.drafted(drafted.committed, drafted.read)
        return drafted, outputs

    def drafted(self, committed: list[list[bool]], read: list[list[bool]]) -> None:
        """The book after a draft block, from its read-back flags [k][S]: each slot's committed tokens and those the
        SLM read (a frontier row's last token stays unread: the LLM's comes next), one SLM forward per step."""
        for r in range(self.slots):
            self.book.length[r] += sum(step[r] for step in committed)
            self.book.seen["slm"][r] += sum(step[r] for step in read)
        for step in read:
            self.counters.forward("slm", self.slots, 1, sum(step), self.slots)

    def route(self, logits: torch.Tensor, hidden: torch.Tensor, token: torch.Tensor) -> torch.Tensor:
        p = self.pair
        if self.router_step is not None and getattr(p.router, "capturable", True):
            return self.router_step(logits, hidden, token)
        return route_scores(p.slm, p.router, p.num_topk, logits, hidden, token)

    def _read(self, role: str, rows: list[int], limit: int | None = None, short: int = 0):
        """``role`` reads each row's unread tokens but the last ``short`` (at most ``limit`` of them), in the forwards
        ``SlotBook.read`` plans; returns the rows read to their end, with the logits, the hidden states (the SLM's;
        else None) and the router's scores of their argmax proposal (the SLM's where the router is folded into its
        reads; else None) after their last token."""
        model, cache = (self.pair.slm, self.slm_cache) if role == "slm" else (self.pair.llm, self.llm_cache)
        captured = None if self.captured is None else self.captured[role]
        if getattr(captured, "packed", False):  # (``fast/packed_reads.py``)
            return self._read_packed(captured, rows, limit, short)
        forwards = self.book.read(role, rows, limit, short, PIECE if captured is None else captured.piece)
        outputs: dict[int, tuple] = {}
        before = cache.gathered_bytes
        for forward in forwards:
            who, starts, counts = (list(column) for column in zip(*forward))
            if captured is None:
                out = (*read_piece(model, cache, self.tokens, who, starts, counts, hidden=role == "slm"), None)
            else:
                out = captured.read(self.tokens, who, starts, counts)
            self.counters.forward(role, len(who), max(counts), sum(counts), self._computed(captured, who, counts))
            for j, (r, start, n) in enumerate(forward):
                if start + n == self.book.length[r]:  # read to its end: its next-token outputs
                    outputs[r] = tuple(None if value is None else value[j] for value in out)
        self.counters.gathered_bytes += cache.gathered_bytes - before
        done = [r for r in rows if r in outputs]
        if not done:
            return [], None, None, None
        if len(forwards) == 1 and who == done:  # one forward read every row to its end, in order: its outputs
            return (done, *out)
        return (done, *(None if out[i] is None else torch.stack([outputs[r][i] for r in done]) for i in range(3)))

    @staticmethod
    def _computed(captured, rows: list[int], counts: list[int]) -> int:
        """Token-rows a padded read of ``rows`` computes: its rectangle, or the buckets its captured replay pads to."""
        if captured is None:
            return len(rows) * max(counts)
        k, width, _ = captured.shape(rows, counts)
        return k * width

    def _read_packed(self, reads, rows: list[int], limit: int | None, short: int):
        """``_read`` for the LLM's packed reads: one flat forward per piece of at most ``GROUPS[-1]`` tokens per row,
        the logits after the last token of each row read to its end."""
        outputs = {}
        for forward in self.book.packed(rows, limit, short):
            keep = [(r, start + n - 1) for r, start, n in forward if start + n == self.book.length[r]]
            for (r, _), logits in zip(keep, self._packed(reads, forward, keep, reads.kept[False])):
                outputs[r] = logits
        done = [r for r in rows if r in outputs]
        return (done, torch.stack([outputs[r] for r in done]), None, None) if done else ([], None, None, None)

    def _packs(self) -> bool:
        """Whether the LLM's reads are packed (captured fused: ``fast/packed_reads.py``)."""
        return self.captured is not None and getattr(self.captured["llm"], "packed", False)

    def _packed(self, reads, forward: list[tuple[int, int, int]], keep: list[tuple[int, int]],
                kept: int) -> torch.Tensor:
        """One packed read of ``forward``'s (row, first column, tokens); the logits after each of ``keep``."""
        who, starts, counts = (list(column) for column in zip(*forward))
        plan = pack(who, starts, counts, keep, kept)
        self.counters.forward("llm", len(who), max(counts), real=plan.real, read=plan.width)
        return reads.read(self.tokens, plan)

    def close(self) -> None:
        pass
