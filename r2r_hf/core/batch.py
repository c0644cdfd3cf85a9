"""The running batch: one value holding every row a decoding loop advances, its caches and each row's progress.

``generate`` builds one for its call (``for_call``: every row of its left-padded prompt on HF's caches, a
``RectangleLayout``; the server builds the same for an answer of a model that cannot use slots); the server keeps
one for its lifetime (``for_slots``), in which requests ``join`` free slots and ``leave`` them (a ``SlotLayout``).
Both advance it with ``turn.decode_step``: it is a ``turn.DeviceStep`` (``propose``, ``sync``, ``read_llm``,
``commit``; the server's also ``draft``: ``turn.decode_block``), and it has a ``ledger.Ledger``, each row's progress.

Per row: its committed tokens and both models' caches (the layout's), the SLM's outputs after its last token (its
next proposal comes from them), its threshold, its budget state, how its tokens are chosen (``choice.py``). What is
the same for every row (the router, the shared vocabulary) is the ``RoutedPair``'s.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from .budget import Budget
from .choice import CallChoice, Chooser, RowChoice
from .counters import Counters
from .fast.drafts import ENDS
from .fast.router_copy import stateless
from .layouts import Layout
from .layouts.rectangle import Committed, RectangleLayout
from .layouts.slot_layout import SlotLayout
from .ledger import Joiner, Ledger, RowState
from .moves import BlockPlan, Drafted
from .pair import RoutedPair
from .plan import Outcome, StepPlan
from .policy import WaitPolicy
from .routing import Routing, fixed_routing
from .speculation import chances, resolve, roll_back, waits
from .staging import CHANCE_UNIT, in_order, in_units, staged
from .step import LLMRead, Proposal, Synced


class RunningBatch:
    """Every row one loop decodes (see the module docstring). Built by ``for_call`` or ``for_slots``.

    Args:
        keeps_streams: the ledger keeps each written token's random stream (``generate``'s sampled calls: the call's
            stream ends where its last answer token's draw left it, whatever a speculative tail drew past it).
    """

    def __init__(self, pair: RoutedPair, layout: Layout, choice: Chooser, counters: Counters, slots: int,
                 device: torch.device, budget: Budget | None, keeps_streams: bool = False) -> None:
        self.ledger = Ledger(slots, lockstep=layout.lockstep)
        self.lockstep, self.keeps_streams = layout.lockstep, keeps_streams
        self.pair, self.layout, self.choice, self.counters = pair, layout, choice, counters
        self.device = device
        self.slm_logits: torch.Tensor | None = None  # [S, V] the SLM after each row's last token
        self.slm_hidden: torch.Tensor | None = None  # [S, H] its post-norm hidden state there
        self.slm_scores: torch.Tensor | None = None  # [S] the router's scores of its argmax there (folded reads)
        self.unscored: set[int] = set(range(slots))  # rows whose SLM outputs came without folded scores
        self.thresholds = torch.full((slots,), math.inf, device=device)
        self.running = torch.ones(slots, dtype=torch.bool, device=device)  # generate: rows not finished
        self.last_token = torch.full((slots,), -1, dtype=torch.long, device=device)  # committed at the last step
        self.budget = budget

    # ------------------------------------------------------------ building
    @classmethod
    def for_call(cls, routing: Routing, input_ids: torch.Tensor, new_tokens: int,
                 attention_mask: torch.Tensor | None = None, position_ids: torch.Tensor | None = None,
                 pad: torch.Tensor | None = None, counters: Counters | None = None, scored: bool = True,
                 ends: frozenset[int] = frozenset()) -> RunningBatch:
        """A generate call's batch over its left-padded prompts ``input_ids`` [B, P] (every row of the rectangle,
        at most ``new_tokens`` each; finished rows commit ``pad``); the SLM reads the prompts. ``scored``: the call
        returns the router's scores (``routing.fixed_routing``); ``ends``: the tokens that end an answer."""
        counters = counters or Counters()
        seq = Committed.from_prompt(input_ids, attention_mask, position_ids, routing.calls.capacity)
        able = routing.pair.abilities
        recurrent = frozenset(role for role in ("slm", "llm") if "recurrent" in getattr(able, role).kinds)
        layout = RectangleLayout(routing.calls, seq, counters, pad, recurrent)
        choice = CallChoice(routing.processors, routing.sampler, routing.vocab_size,
                            lambda index=None: layout.row_ids(0, index))
        rows, device = input_ids.shape[0], input_ids.device
        budget = None if routing.llm_budget is None else Budget.start(routing.llm_budget, rows, new_tokens, device)
        batch = cls(routing.pair, layout, choice, counters, rows, device, budget, routing.sampler.do_sample)
        routes = fixed_routing(routing.threshold, routing.llm_budget, scored)
        for r in range(rows):
            batch.ledger.admit(r, RowState(max_new=new_tokens, routes=routes, ends=ends))
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
        budget = Budget.start(math.inf, slots, 1, device, kept=set())  # every row has a budget state (inf: none)
        batch = cls(pair, layout, choice, counters, slots, device, budget)
        batch.running.fill_(False)
        return batch

    # ------------------------------------------------------------ rows
    def join(self, joiners: list[Joiner], prefill: int | None = None) -> list[int]:
        """Put each joiner in a free slot (the lowest first); the SLM reads their prompts in one forward, or, with
        ``prefill``, both models read at most that many prompt tokens per ``prefill`` call (chunked prefill). No
        running row's cache moves, unless a prompt needs more columns than the slots have (then every slot grows:
        ``counters.join_bytes`` counts the bytes copied). Returns the slots taken."""
        layout, rows = self.layout, self.ledger.rows
        free = [r for r, row in enumerate(rows) if row is None][: len(joiners)]
        if len(free) < len(joiners):
            raise ValueError(f"{len(joiners)} rows cannot join a batch with {len(free)} free slots")
        needed = max(len(j.prompt) + j.max_new for j in joiners) + 1
        self.counters.join_bytes += layout.reserve(len(rows), needed)
        for slot, joiner in zip(free, joiners):
            layout.place(slot, joiner.prompt)
            routes = fixed_routing(joiner.threshold, joiner.llm_budget)  # (nothing reads a served row's scores)
            self.ledger.admit(slot, RowState(owner=joiner.owner, max_new=joiner.max_new, routes=routes,
                                             ends=joiner.ends, depth=joiner.depth, prefilling=prefill is not None))
            self.choice.set(slot, joiner.rule)
            self.thresholds[slot] = joiner.threshold
            self.budget.place(slot, math.inf if joiner.llm_budget is None else joiner.llm_budget, joiner.max_new)
            self.running[slot] = True
            self.last_token[slot] = -1
        self.counters.joins += len(joiners)
        if prefill is None:
            self._ready(free, *layout.slm_read(free))
        return free

    def prefill(self, limit: int) -> list[int]:
        """Both models read at most ``limit`` more prompt tokens of each prefilling row; the rows now ready."""
        rows = self.ledger.prefilling()
        if not rows:
            return []
        done, *outputs = self.layout.prefill(rows, limit)
        if done:
            self._ready(done, *outputs)
        return done

    def _ready(self, rows: list[int], logits: torch.Tensor, hidden: torch.Tensor,
               scores: torch.Tensor | None = None) -> None:
        """Rows whose prompt the SLM has read: their first proposal comes from these outputs (``store_slm``)."""
        self.store_slm(rows, logits, hidden, scores)
        self.ledger.ready(rows)

    def store_slm(self, rows: list[int], logits: torch.Tensor, hidden: torch.Tensor,
                  scores: torch.Tensor | None = None) -> None:
        """The SLM's logits [k, V] and hidden states [k, H] after the last token of each of ``rows``, and where its
        read folded the router, the router's scores [k] of each row's argmax proposal (``layouts.Layout.slm_read``).

        Into new tensors, never in place: a captured router skips copying an input it was given last time as the
        same tensor (``fast/graphs.CudaGraphStep``), and the proposals of every slot are these tensors themselves."""
        (self.unscored.update if scores is None else self.unscored.difference_update)(rows)
        at = self.index(rows)
        if at is None:
            self.slm_logits, self.slm_hidden, self.slm_scores = logits, hidden, scores
            return
        if self.slm_logits is None:
            self.slm_logits = logits.new_zeros(len(self.ledger.rows), logits.shape[-1])
            self.slm_hidden = hidden.new_zeros(len(self.ledger.rows), hidden.shape[-1])
        self.slm_logits = self.slm_logits.index_put((at.to(self.slm_logits.device),), logits)
        self.slm_hidden = self.slm_hidden.index_put((at.to(self.slm_hidden.device),), hidden.to(self.slm_hidden.device))
        if scores is not None:
            scored = scores.new_zeros(len(self.ledger.rows)) if self.slm_scores is None else self.slm_scores
            self.slm_scores = scored.index_put((at.to(scored.device),), scores.to(scored.dtype))

    def leave(self, rows: list[int]) -> None:
        """Free the slots of ``rows`` (nothing is copied: a later row writes over them)."""
        self.ledger.release(rows)
        for r in rows:
            self.layout.free(r)
            self.choice.set(r, None)
            self.running[r] = False
            self.last_token[r] = -1
            self.thresholds[r] = math.inf
            if self.budget is not None:
                self.budget.kept.discard(r)

    # ------------------------------------------------------------ the step's device side (``turn.DeviceStep``)
    def propose(self, policy: WaitPolicy) -> Proposal:
        """Every proposing row's token, router score and routing decision (device values; nothing waits); where rows
        may speculate, also each row's stream after its draw (a row that goes on past a routed position keeps it)
        and where a routed row waits rather than speculate (``speculation.waits``)."""
        rows, speculate = self.ledger.proposing(), policy.speculate > 0
        if not rows:
            nothing = torch.zeros(0, device=self.device)
            return Proposal(rows, None, None, None, None, None, nothing, nothing.bool(), {}, {}, None)
        index = self.proposal_index(rows)
        logits, hidden = _taken(self.slm_logits, index), _taken(self.slm_hidden, index)
        states = self.choice.state(rows)  # kept so the LLM can draw in the SLM's place
        scores, token, ok = self.choice.propose(logits, rows, rows if index is None else None)
        after = self.choice.state(rows) if speculate else {}
        thresholds = _taken(self.thresholds, index)
        router_scores, routed = self._route(rows, index, logits, hidden, token, thresholds)
        if self.lockstep:  # a rectangle's finished rows route nothing (a slot's proposers all run)
            routed &= self.running
        if not self._spends_none(rows):
            live = _taken(self.running, index)
            budget_rows = None if index is None else index.to(self.budget.share.device)
            routed &= self.budget.allows(router_scores, budget_rows)
            self.budget.spend(router_scores, routed, live, budget_rows)
        if not speculate:
            return Proposal(rows, index, logits, scores, token, ok, router_scores, routed, states, after)
        chance = chances(policy, scores, token)
        return Proposal(rows, index, logits, scores, token, ok, router_scores, routed, states, after,
                        waits(policy, router_scores, chance, thresholds),
                        in_units(chance) if policy.draft_cost > 0 else None)

    def _route(self, rows: list[int], index: torch.Tensor | None, logits: torch.Tensor, hidden: torch.Tensor,
               token: torch.Tensor, thresholds: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The router's scores of the proposals and where they reach each row's threshold (``thresholds``, the
        proposers'); it does not run (scores NaN) where every proposing row's routing is fixed (``RowState.routes``:
        rows at thresholds <= 0 route)."""
        if all(self.ledger.rows[r].routes is not None for r in rows):
            nothing = torch.full(token.shape, math.nan, device=token.device)
            return nothing, thresholds.to(token.device) <= 0
        self.counters.router_steps += 1
        if self.unscored.isdisjoint(rows) and self.choice.argmax(rows):  # scored in the SLM's read (folded)
            router_scores = _taken(self.slm_scores, index).to(token.device)
        else:
            self.pair.router.step()
            if getattr(self.pair.router, "per_row", False):  # its draws are keyed by row and answer position
                self.pair.router.rows_scored([self.ledger.rows[r] for r in rows])
            router_scores = self.layout.route(logits, hidden, token).to(token.device)
        return router_scores, router_scores >= thresholds

    def sync(self, proposal: Proposal, extra: tuple[torch.Tensor, ...] = ()) -> Synced:
        """The step's one host synchronisation: this step's routing and draw flags, the previous step's tokens."""
        n, s, device = len(proposal.routed), len(self.ledger.rows), proposal.routed.device
        at = proposal.rows if proposal.index is None else range(n)  # each proposing row's entry
        flags = self.choice.flags()
        parts = [proposal.routed, self.last_token.to(device)]  # (cat promotes bool to long: no cast kernel)
        parts += [part.reshape(-1).to(device) for part in (proposal.ok, flags, *extra) if part is not None]
        tail = [part for part in (proposal.sure, proposal.chance) if part is not None]
        parts += [part.to(device) for part in tail]  # last: n entries each, like routed
        flat = torch.cat(parts).tolist()
        self.counters.host_syncs += 1
        end = n + s
        failed = set()
        if proposal.ok is not None:
            failed = {r for r, i in zip(proposal.rows, at) if not flat[end + i]}
            end += n
        if flags is not None:
            failed |= {r for r, v in enumerate(flat[end : end + s]) if v}
            end += s
        delivered = self.ledger.arrive(flat[n : n + s])
        stop = len(flat) - n * len(tail)
        sure = [bool(flat[stop + i]) for i in at] if proposal.sure is not None else []
        units = len(flat) - n  # (the chances, where read, come last)
        chance = [flat[units + i] / CHANCE_UNIT for i in at] if proposal.chance is not None else []
        return Synced([bool(flat[i]) for i in at], delivered, failed, flat[end:stop], sure, chance)

    def read_llm(self, plan: StepPlan, proposal: Proposal) -> LLMRead:
        """The LLM's read ``plan`` asks for: a resolution (``speculation.resolve``), or its catch-up, in which it
        reads what it has not read of ``plan.llm_reads`` and draws in the SLM's place for ``plan.llm_writers``."""
        if plan.resolving:
            return resolve(self, plan, proposal)
        if not plan.llm_writers:
            return LLMRead()
        logits = self.layout.llm_read(list(plan.llm_reads))
        states = {r: self.ledger.stream_before(r, proposal.states) for r in plan.llm_writers}
        scores, token, ok = self.choice.redraw(logits, list(plan.llm_reads), list(plan.llm_writers), states)
        at = self.index(list(plan.llm_writers))
        self.choice.flag(at, ok)  # read in the next step's synchronisation
        return LLMRead(plan.llm_writers, token, at, scores=scores, logits=logits)

    def commit(self, proposal: Proposal, plan: StepPlan, outcome: Outcome,
               read: LLMRead) -> tuple[torch.Tensor, dict[int, Any]]:
        """Roll back where ``outcome`` says, commit each writer's token (the LLM's where it wrote, the SLM's
        proposal elsewhere) and let the SLM read the committed tokens of the rows that propose again."""
        roll_back(self, outcome, read.streams)
        committed, holding = self._proposed(proposal)
        if outcome.llm_writers:
            same = outcome.llm_writers == read.rows
            at = read.index if same else self.index(list(outcome.llm_writers))
            tokens = read.tokens_of(outcome.llm_writers)
            committed = tokens if at is None else committed.index_put((at,), tokens)
        if outcome.kept:  # (lockstep: rows cut back with a rejected one keep their token at the cut)
            kept = torch.stack([self.layout.tokens_at(r, [outcome.rollbacks[r]])[0] for r in outcome.kept])
            committed = committed.index_put((staged(list(outcome.kept), self.device),), kept.to(committed.device))
        writers = outcome.writers
        if holding - set(writers):  # a routed row that waits, one that ended, a slot that did not propose: nothing
            committed = torch.where(_mask(writers, len(self.ledger.rows), self.device), committed, -1)
        if writers:  # (a rectangle commits the pad for its finished rows)
            committed = self.layout.append(list(writers), committed, self.running)
        self.last_token = committed
        # a row's first pending token: its SLM state kept before the SLM reads it (a rollback returns there; rows in
        # lockstep are cut back together: their checkpoint stands before the first pending token of any row)
        first = [r for r in plan.speculating if not self.ledger.rows[r].pending]
        if first and not (self.lockstep and self.ledger.speculating()):
            self.layout.keep("slm", first)
        if outcome.slm_reads:
            self.store_slm(list(outcome.slm_reads), *self.layout.slm_read(list(outcome.slm_reads)))
        if self.budget is not None:
            self.budget.remember(plan.step, bool(plan.speculating) or self.ledger.speculating(),
                                 self.ledger.oldest_tail_step(plan.step))
        return committed, self.choice.state(list(writers)) if self.keeps_streams else {}

    def draft(self, plan: BlockPlan) -> Drafted | None:
        """``plan``'s block drafted on the device, read back once (``fast/drafts.py``; the ledger is not touched);
        None where a block cannot stand for its rows' steps (a row samples, has processors, a budget or over
        ``drafts.ENDS`` end tokens; the reads do not fold the router, or no blocks of this size are captured)."""
        drafts = self.layout.drafts
        rows = list(plan.rows)
        if (drafts is None or drafts.k != plan.steps or not self.unscored.isdisjoint(rows)
                or not self.choice.argmax(rows) or not self._spends_none(rows) or max(map(len, plan.ends)) > ENDS):
            return None
        # rows that may speculate inside the block: their SLM state kept first (a rollback returns there)
        self.layout.keep("slm", [r for r in rows if plan.standing[r].depth and not plan.standing[r].pending])
        # (copies: thresholds and last tokens change in place, and a captured step copies a tensor it saw last once)
        drafted, (self.slm_logits, self.slm_hidden, self.slm_scores) = self.layout.draft(
            plan, logits=self.slm_logits, hidden=self.slm_hidden, scores=self.slm_scores,
            thresholds=self.thresholds.clone(), previous=self.last_token.clone())
        self.counters.host_syncs += 1
        return drafted

    def delivers(self, tokens: list[int]) -> None:
        """After a draft block: the token each slot committed that reaches the host at the next step (-1: none)."""
        self.last_token = staged(tokens, self.device)

    def _proposed(self, proposal: Proposal) -> tuple[torch.Tensor, set[int]]:
        """[S] this step's proposals at their slots, and the slots whose entry holds a token (a proposal, or what a
        slot that did not propose holds where the proposals cover every slot: ``Proposal.index``)."""
        slots = len(self.ledger.rows)
        if not proposal.rows:
            return torch.full((slots,), -1, dtype=torch.long, device=self.device), set()
        if proposal.index is None:
            return proposal.token, set(range(slots))
        empty = torch.full((slots,), -1, dtype=torch.long, device=self.device)
        return empty.index_put((proposal.index,), proposal.token), set(proposal.rows)

    def _spends_none(self, rows: list[int]) -> bool:
        """Whether none of ``rows`` keeps a budget (their step spends none)."""
        return self.budget is None or self.budget.kept.isdisjoint(rows)

    def index(self, rows: list[int]) -> torch.Tensor | None:
        """Rows as an index tensor (staged: the host does not wait), or None when they are every slot in order."""
        if len(rows) == len(self.ledger.rows) and in_order(rows):
            return None
        return staged(rows, self.device)

    def proposal_index(self, rows: list[int]) -> torch.Tensor | None:
        """How ``propose`` takes the proposing ``rows``' values (``step.Proposal``): None, at their slots, where
        nothing needs them gathered; else their index. Gathered where a proposing row keeps a budget (its state is
        spent per proposal) or the router is no pure function (per-step state, its own draws: it would see the other
        slots too)."""
        router = self.pair.router
        pure = stateless(router) and getattr(router, "capturable", True)
        if not self.lockstep and self._spends_none(rows) and pure:
            return None
        return self.index(rows)

    def close(self) -> None:
        self.layout.close()


def _mask(rows, slots: int, device: torch.device) -> torch.Tensor:
    """[slots] bool, True at ``rows`` (staged)."""
    chosen = set(rows)
    return staged([r in chosen for r in range(slots)], device, torch.bool)


def _taken(values: torch.Tensor, index: torch.Tensor | None) -> torch.Tensor:
    return values if index is None else values[index.to(values.device)]
