"""The running batch: one value holding every row a decoding loop advances, its caches and each row's progress.

``generate`` builds one for its call (every row of its left-padded prompt, on HF's caches: a
``RectangleLayout``); the server keeps one for its lifetime, in which requests ``join`` free slots and
``leave`` them (a ``SlotLayout``). Both advance it with ``step.decode_step``.

Per row: its committed tokens and both models' caches (the layout's, each model's read progress per row),
the SLM's logits and hidden state after its last token (its next proposal comes from them), its threshold,
its budget state, how its tokens are chosen (``choice.py``), and whether it waits for the LLM (since which
step, and where its random stream stood). What is the same for every row (the router, the shared vocabulary)
is the ``RoutedPair``'s.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from .budget import Budget
from .choice import CallChoice, RowChoice, RowRule
from .counters import Counters
from .layouts.rectangle import RectangleLayout
from .layouts.slot_layout import SlotLayout
from .pair import RoutedPair


@dataclass
class RowState:
    """One row's host-side state between steps.

    Args:
        owner: what the row answers (the server's answer object; None in ``generate``).
        max_new: tokens the row may still commit at most (it drains after the last: ``draining``).
        waiting_since: the step it was routed at while it waits for the LLM (None: not waiting).
        rng: its random stream before the SLM draw that routed it (the LLM draws from there).
        by_llm: whether the token it committed last came from the LLM (its value reaches the host next step).
        draining: it committed its last token; it proposes no more and leaves once the host has read it.
        prefilling: its prompt is still being read (a piece per turn: ``RunningBatch.prefill``).
    """

    owner: Any = None
    max_new: int = 2**62
    waiting_since: int | None = None
    rng: Any = None
    by_llm: bool = False
    draining: bool = False
    prefilling: bool = False


@dataclass
class Joiner:
    """A row asking to join: its prompt and settings (the server's ``RunningBatch.join`` takes a list)."""

    prompt: list[int]
    max_new: int
    threshold: float
    rule: RowRule
    llm_budget: float | None = None
    owner: Any = None


class RunningBatch:
    """Every row one loop decodes (see the module docstring). Built by ``for_call`` or ``for_slots``."""

    def __init__(self, pair: RoutedPair, layout, choice, counters: Counters, slots: int, device: torch.device,
                 budget: Budget | None, pad: int | None = None) -> None:
        self.pair, self.layout, self.choice, self.counters = pair, layout, choice, counters
        self.device = device
        self.rows: list[RowState | None] = [None] * slots
        self.slm_logits: torch.Tensor | None = None  # [S, V] the SLM after each row's last token
        self.slm_hidden: torch.Tensor | None = None  # [S, H] its post-norm hidden state there
        self.thresholds = torch.full((slots,), math.inf, device=device)
        self.running = torch.ones(slots, dtype=torch.bool, device=device)  # generate: rows not finished
        self.last_token = torch.full((slots,), -1, dtype=torch.long, device=device)  # committed at the last step
        self.budget, self.pad = budget, pad
        self.step_no = 0
        self.keep_outputs = False  # generate's output_scores/output_logits: the step returns what it chose from

    # ------------------------------------------------------------ building
    @classmethod
    def for_call(cls, pair: RoutedPair, layout: RectangleLayout, choice: CallChoice, threshold: float,
                 llm_budget: float | None, new_tokens: int, pad: int | None, counters: Counters) -> RunningBatch:
        """A generate call's batch over its prompt (every row of the rectangle); the SLM reads the prompt."""
        rows = layout.rows
        device = layout.seq.ids.device
        budget = None if llm_budget is None else Budget.start(llm_budget, rows, new_tokens, device)
        batch = cls(pair, layout, choice, counters, rows, device, budget, pad)
        batch.rows = [RowState(max_new=new_tokens) for _ in range(rows)]
        batch.thresholds.fill_(threshold)
        batch.slm_logits, batch.slm_hidden = layout.slm_read(list(range(rows)))
        return batch

    @classmethod
    def for_slots(cls, pair: RoutedPair, slots: int, capacity: int, device: torch.device,
                  counters: Counters | None = None) -> RunningBatch:
        """An empty batch of ``slots`` slots (the server's); rows ``join`` and ``leave`` it."""
        counters = counters or Counters()
        layout = SlotLayout(pair, slots, capacity, counters)
        choice = RowChoice(pair.vocab_size, layout.row_ids, slots, device)
        budget = Budget.start(math.inf, slots, 1, device)  # every row keeps a budget state (inf: none)
        batch = cls(pair, layout, choice, counters, slots, device, budget)
        batch.running.fill_(False)
        return batch

    # ------------------------------------------------------------ rows
    def occupied(self) -> list[int]:
        return [r for r, row in enumerate(self.rows) if row is not None]

    def proposing(self) -> list[int]:
        """Rows that propose this step: in the batch, prompt read, not waiting for the LLM, not draining."""
        return [r for r, row in enumerate(self.rows) if row is not None and row.waiting_since is None
                and not row.draining and not row.prefilling]

    def decoding(self) -> bool:
        """Whether a step has anything to do (a row proposes, waits for the LLM or has a token to hand over)."""
        return any(row is not None and not row.prefilling for row in self.rows)

    def prefilling(self) -> list[int]:
        return [r for r, row in enumerate(self.rows) if row is not None and row.prefilling]

    def waiting(self) -> list[int]:
        return [r for r, row in enumerate(self.rows) if row is not None and row.waiting_since is not None]

    def free_slots(self) -> int:
        return sum(row is None for row in self.rows)

    def join(self, joiners: list[Joiner], prefill: int | None = None) -> list[int]:
        """Put each joiner in a free slot (the lowest first); the SLM reads their prompts in one forward, or, with
        ``prefill``, both models read at most that many prompt tokens per ``prefill`` call (chunked prefill: a long
        prompt does not hold up the running rows' next token for its whole read).

        No running row's cache moves, unless a prompt needs more columns than the slots have (then every
        slot grows: the bytes copied are counted in ``counters.join_bytes``). Returns the slots taken.
        """
        layout = self.layout
        free = [r for r, row in enumerate(self.rows) if row is None][: len(joiners)]
        if len(free) < len(joiners):
            raise ValueError(f"{len(joiners)} rows cannot join a batch with {len(free)} free slots")
        needed = max(len(j.prompt) + j.max_new for j in joiners) + 1
        self.counters.join_bytes += layout.reserve(len(self.rows), needed)
        for slot, joiner in zip(free, joiners):
            layout.place(slot, joiner.prompt)
            self.rows[slot] = RowState(owner=joiner.owner, max_new=joiner.max_new)
            self.choice.set(slot, joiner.rule)
            self.thresholds[slot] = joiner.threshold
            share = math.inf if joiner.llm_budget is None else joiner.llm_budget
            self.budget.place(slot, share, joiner.max_new)
            self.running[slot] = True
            self.last_token[slot] = -1
        self.counters.joins += len(joiners)
        if prefill is None:
            self._ready(free, *layout.slm_read(free))
        else:
            for slot in free:
                self.rows[slot].prefilling = True
        return free

    def prefill(self, limit: int) -> list[int]:
        """Both models read at most ``limit`` more prompt tokens of each prefilling row; the rows now ready."""
        rows = self.prefilling()
        if not rows:
            return []
        done, logits, hidden = self.layout.prefill(rows, limit)
        if done:
            self._ready(done, logits, hidden)
        return done

    def _ready(self, rows: list[int], logits: torch.Tensor, hidden: torch.Tensor) -> None:
        """Rows whose prompt the SLM has read: their first proposal comes from ``logits`` and ``hidden``."""
        if self.slm_logits is None:
            self.slm_logits = logits.new_zeros(len(self.rows), logits.shape[-1])
            self.slm_hidden = hidden.new_zeros(len(self.rows), hidden.shape[-1])
        index = torch.tensor(rows, device=self.slm_logits.device)
        self.slm_logits[index], self.slm_hidden[index] = logits, hidden.to(self.slm_hidden.device)
        for r in rows:
            self.rows[r].prefilling = False

    def leave(self, rows: list[int]) -> None:
        """Free the slots of ``rows`` (nothing is copied: a later row writes over them)."""
        for r in rows:
            self.rows[r] = None
            self.layout.free(r)
            self.choice.set(r, None)
            self.running[r] = False
            self.last_token[r] = -1
            self.thresholds[r] = math.inf

    def index(self, rows: list[int]) -> torch.Tensor | None:
        """Rows as an index tensor, or None when they are every slot in order (no gather needed)."""
        if len(rows) == len(self.rows) and rows == list(range(len(rows))):
            return None
        return torch.tensor(rows, dtype=torch.long, device=self.device)

    def close(self) -> None:
        self.layout.close()
