"""The running batch: one value holding every row a decoding loop advances, its caches and each row's progress.

``generate`` builds one for its call (``for_call``: every row of its left-padded prompt on HF's caches, a
``RectangleLayout``; the server builds the same for an answer of a model that cannot use slots); the server keeps
one for its lifetime (``for_slots``), in which requests ``join`` free slots and ``leave`` them (a ``SlotLayout``).
Both advance it with ``turn.decode_step``: its device side (``propose``, ``sync``, ``execute``) is
``step.DeviceStep``'s, its host side — a ``RowState`` per slot and the step counter — ``plan.BatchRows``'.

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
from .choice import CallChoice, Chooser, RowChoice, RowRule
from .counters import Counters
from .fast.router_copy import stateless
from .layouts import Layout
from .layouts.rectangle import Committed, RectangleLayout
from .layouts.slot_layout import SlotLayout
from .pair import RoutedPair
from .rows import RowState
from .routing import Routing
from .staging import in_order, staged
from .step import DeviceStep


@dataclass
class Joiner:
    """A row asking to join: its prompt and settings (the server's ``RunningBatch.join`` takes a list)."""

    prompt: list[int]
    max_new: int
    threshold: float
    rule: RowRule
    llm_budget: float | None = None
    owner: Any = None


class RunningBatch(DeviceStep):
    """Every row one loop decodes (see the module docstring). Built by ``for_call`` or ``for_slots``."""

    def __init__(self, pair: RoutedPair, layout: Layout, choice: Chooser, counters: Counters, slots: int,
                 device: torch.device, budget: Budget | None) -> None:
        super().__init__(slots, cuts_together=layout.reads_every_row)
        self.pair, self.layout, self.choice, self.counters = pair, layout, choice, counters
        self.device = device
        self.slm_logits: torch.Tensor | None = None  # [S, V] the SLM after each row's last token
        self.slm_hidden: torch.Tensor | None = None  # [S, H] its post-norm hidden state there
        self.thresholds = torch.full((slots,), math.inf, device=device)
        self.running = torch.ones(slots, dtype=torch.bool, device=device)  # generate: rows not finished
        self.last_token = torch.full((slots,), -1, dtype=torch.long, device=device)  # committed at the last step
        self.budget = budget
        self.budgeted: set[int] = set(range(slots)) if budget is not None else set()  # rows with a budget to keep
        self.budget_log: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # step -> budget state (speculation)

    # ------------------------------------------------------------ building
    @classmethod
    def for_call(cls, routing: Routing, input_ids: torch.Tensor, new_tokens: int,
                 attention_mask: torch.Tensor | None = None, position_ids: torch.Tensor | None = None,
                 pad: torch.Tensor | None = None, counters: Counters | None = None) -> RunningBatch:
        """A generate call's batch over its left-padded prompts ``input_ids`` [B, P] (every row of the rectangle,
        at most ``new_tokens`` each; finished rows commit ``pad``); the SLM reads the prompts."""
        counters = counters or Counters()
        seq = Committed.from_prompt(input_ids, attention_mask, position_ids, routing.calls.capacity)
        layout = RectangleLayout(routing.calls, seq, counters, pad)
        choice = CallChoice(routing.processors, routing.sampler, routing.vocab_size,
                            lambda index=None: layout.row_ids(0, index))
        rows, device = input_ids.shape[0], input_ids.device
        budget = None if routing.llm_budget is None else Budget.start(routing.llm_budget, rows, new_tokens, device)
        batch = cls(routing.pair, layout, choice, counters, rows, device, budget)
        batch.rows = [RowState(max_new=new_tokens) for _ in range(rows)]
        batch.thresholds.fill_(routing.threshold)
        batch.store_slm(list(range(rows)), *layout.slm_read(list(range(rows))))
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
        batch.budgeted = set()
        return batch

    # ------------------------------------------------------------ rows
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
            if joiner.llm_budget is not None:
                self.budgeted.add(slot)
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
        self.store_slm(rows, logits, hidden)
        for r in rows:
            self.rows[r].prefilling = False

    def store_slm(self, rows: list[int], logits: torch.Tensor, hidden: torch.Tensor) -> None:
        """The SLM's logits [k, V] and hidden states [k, H] after the last token of each of ``rows``.

        Into new tensors, never in place: a captured router skips copying an input it was given last time as the
        same tensor (``fast/graphs.CudaGraphStep``), and the proposals of every slot are these tensors themselves."""
        at = self.index(rows)
        if at is None:
            self.slm_logits, self.slm_hidden = logits, hidden
            return
        if self.slm_logits is None:
            self.slm_logits = logits.new_zeros(len(self.rows), logits.shape[-1])
            self.slm_hidden = hidden.new_zeros(len(self.rows), hidden.shape[-1])
        self.slm_logits = self.slm_logits.index_put((at.to(self.slm_logits.device),), logits)
        self.slm_hidden = self.slm_hidden.index_put((at.to(self.slm_hidden.device),), hidden.to(self.slm_hidden.device))

    def leave(self, rows: list[int]) -> None:
        """Free the slots of ``rows`` (nothing is copied: a later row writes over them)."""
        for r in rows:
            self.rows[r] = None
            self.layout.free(r)
            self.choice.set(r, None)
            self.running[r] = False
            self.last_token[r] = -1
            self.thresholds[r] = math.inf
            self.budgeted.discard(r)

    def log_budget(self, plan) -> None:
        """While rows speculate, keep the budget state after each step (a rollback restores a row's from the step
        that committed the token it is cut back to); forget what no rollback can reach."""
        if not self.budgeted or not (plan.speculating or self.speculating()):
            self.budget_log.clear()
            return
        self.budget_log[plan.step] = (self.budget.used.clone(), self.budget.seen.clone())
        first = min((row.tail[0][0] for row in self.rows if row is not None and row.tail), default=plan.step)
        self.budget_log = {step: state for step, state in self.budget_log.items() if step >= first}

    def restore_budget(self, row: int, step: int) -> None:
        """Row ``row``'s budget back to where it stood after step ``step`` (one without a budget keeps none)."""
        if row in self.budgeted:
            used, seen = self.budget_log[step]
            self.budget.used[row], self.budget.seen[row] = used[row], seen[row]

    def index(self, rows: list[int]) -> torch.Tensor | None:
        """Rows as an index tensor (staged: the host does not wait), or None when they are every slot in order."""
        if len(rows) == len(self.rows) and in_order(rows):
            return None
        return staged(rows, self.device)

    def proposal_index(self, rows: list[int]) -> torch.Tensor | None:
        """How ``propose`` takes the proposing ``rows``' values (``step.Proposal``): None, at their slots, where
        nothing needs them gathered; else their index. Gathered where a proposing row keeps a budget (its state is
        spent per proposal) or the router is no pure function (per-step state, its own draws: it would see the other
        slots too)."""
        router = self.pair.router
        pure = stateless(router) and getattr(router, "capturable", True)
        if not self.layout.reads_every_row and self.budgeted.isdisjoint(rows) and pure:
            return None
        return self.index(rows)

    def mask(self, rows) -> torch.Tensor:
        """[S] bool, True at ``rows`` (staged)."""
        chosen = set(rows)
        return staged([r in chosen for r in range(len(self.rows))], self.device, torch.bool)

    def close(self) -> None:
        self.layout.close()
