"""The server's layout: one slot per row, each row at its own length (``slot_cache.py`` holds the KV).

Rows join free slots, leave them and wait for the LLM independently: the LLM reads only the rows asked for, each
from where it last stopped, and a long prompt is read in chunks between the others' steps (``prefill``). How the
models read (eagerly, or captured: padded or packed) is the layout's ``SlotPath`` (``reads.py``): eager when built,
the slots growing (amortised doubling); captured once ``fast/slot_reads.capture_slots`` hands it one, static from
then on."""

from __future__ import annotations

import torch

from ..counters import Counters
from ..features import input_device
from ..moves import BlockPlan
from ..pair import RoutedPair
from ..staging import staged
from .model_calls import route_scores
from .reads import SlotPath, eager_path
from .slot_book import SlotBook
from .slot_cache import SlotCache


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
        able = pair.abilities
        self.slm_cache = SlotCache(pair.slm.config.num_hidden_layers, slots, capacity, "recurrent" in able.slm.kinds)
        self.llm_cache = SlotCache(pair.llm.config.num_hidden_layers, slots, capacity, "recurrent" in able.llm.kinds)
        self.book = SlotBook(slots)  # each row's length and how far each model has read it
        route = lambda logits, hidden, token: route_scores(pair.slm, pair.router, pair.num_topk, logits, hidden,  # noqa
                                                           token)
        self.path: SlotPath = eager_path(pair, self.slm_cache, self.llm_cache, route)

    def use(self, path: SlotPath) -> None:
        """Read with ``path`` from now on (the captured one: ``fast/slot_reads.capture_slots``, before any row joins)."""
        self.path = path

    @property
    def static(self) -> bool:
        """Whether the slots are static (captured steps point at their buffers): they hold ``capacity`` columns."""
        return self.path.static

    @property
    def drafts(self):
        """The draft blocks this layout runs (``fast/drafts.CapturedDrafts``), or None."""
        return self.path.drafts

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
        if self.static:  # captured steps point at these buffers: they never move
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
        """A new answer's prompt in slot ``row`` (which must have room: ``reserve``); neither model read it yet (a
        recurrent state starts from zero)."""
        self.tokens[row, : len(prompt)] = torch.tensor(prompt, dtype=torch.long, device=self.device)
        self.book.place(row, len(prompt))
        for cache in (self.slm_cache, self.llm_cache):
            cache.states.reset(row)

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
        """The row back to its first ``index`` answer tokens: what follows is written over (no cache is moved); a
        model with recurrent layers that read past them goes back to its checkpoint and reads again from there."""
        for role in self.book.cut(row, index):
            cache = self.slm_cache if role == "slm" else self.llm_cache
            if cache.recurrent:
                self.book.restore(role, row)
                cache.states.restore(row)

    def keep(self, role: str, rows: list[int]) -> None:
        """Checkpoint ``role``'s recurrent states of ``rows`` where it has read them to (before it reads a token a
        rollback may cut: ``slot_state.py``); nothing for a model without recurrent layers."""
        cache = self.slm_cache if role == "slm" else self.llm_cache
        if cache.recurrent and rows:
            cache.states.keep(rows)
            self.book.keep(role, rows)

    def predict(self, needs: dict[int, list[int]]) -> dict[int, tuple[list[int], torch.Tensor]]:
        """The LLM reads each row through the token before its last needed answer index; per row, the indices
        ``needs[row]`` and the logits [n, V] predicting each."""
        return self.path.llm.predict(self, needs)

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
        return self.path.slm.read(self, "slm", rows)[1:]

    def llm_read(self, rows: list[int]) -> torch.Tensor:
        """[k, V] logits of the LLM after each row's last committed token (it reads what it has not)."""
        return self.path.llm.read(self, "llm", rows)[1]

    def prefill(self, rows: list[int], limit: int | None) -> tuple:
        """Both models read at most ``limit`` more prompt tokens of each row (a long prompt is read over several
        turns, between the others' steps); the rows whose prompt is now read, with the SLM's outputs after it
        (``slm_read``'s). The LLM reads the prompt here too, all but its last token (its first catch-up reads at
        least that one, and its logits there are the LLM's first token), so that catch-up is short."""
        self.path.llm.prefill(self, rows, limit)
        return self.path.slm.read(self, "slm", rows, limit)

    def draft(self, plan: BlockPlan, **outputs: torch.Tensor) -> tuple:
        """``plan``'s draft block (``fast/drafts.py``) of every slot from each slot's SLM outputs, threshold and last
        token (``outputs``), read back once: what it drafted (``moves.Drafted``) and each slot's SLM outputs after
        it (device values). The block writes the drafted tokens and the SLM's cache; the book counts them
        (``drafted``)."""
        drafted, outputs = self.path.drafts.run(plan, self.book.length, **outputs)
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
        return self.path.route(logits, hidden, token)

    def close(self) -> None:
        pass
