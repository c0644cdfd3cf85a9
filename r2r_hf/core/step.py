"""The device side of one step over a ``RunningBatch``: propose, the one host synchronisation, execute a plan.

``DeviceStep`` holds them (``RunningBatch`` is one); ``turn.decode_step`` runs them in order, with
``plan.plan_step`` deciding in between:

1. ``propose``  every row that is not waiting proposes its next token from the SLM's logits, through its
                processors and its random stream (``choice.py``); the router scores the proposals; a row routes
                where its score reaches its threshold and its budget allows (``budget.py``). Nothing waits for
                the device.
2. ``sync``     the step's one host synchronisation: the routing decisions, together with the tokens the previous
                step committed (the server decodes and stops on them, one step late, so the host never waits
                twice) and whatever the caller's stop rule needs (``turn.Stops``).
3. ``execute``  the plan: the LLM reads every token it has not read of the rows it reads (catch-up) and writes the
                LLM writers' tokens, each drawn from where the row's SLM draw started; each writer commits its
                token; the SLM reads the committed tokens of the rows that propose again.

Nothing is rolled back: a waiting row simply has no token until the LLM runs, and its prefix, processors and
random stream are then what they were when it routed, so its answer is the same as if the LLM had run at once.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from .plan import Settlement, StepPlan
from .rows import BatchRows
from .speculation import resolve


@dataclass(frozen=True)
class Proposal:
    """What the proposing rows offered, on the device (indexed like ``rows``).

    Args:
        rows: the rows that proposed (slot order); index: the same as a device index (None: every slot in order).
        logits: [k, V] the SLM's logits they proposed from; hidden: [k, H] its hidden states.
        scores: [k, V] the processed scores; token: [k] the proposals; ok: [k] whether a draw had a probability
            to draw from (None: it cannot fail).
        router_scores: [k] the router's scores; routed: [k] where the row routes.
        states: each row's random stream before its draw (the LLM draws from there); after: after it (speculation).
        sure: [k] where the router's score reaches ``WaitPolicy.speculate_below`` (None: no row speculates).
    """

    rows: list[int]
    index: torch.Tensor | None
    logits: torch.Tensor | None
    scores: torch.Tensor | None
    token: torch.Tensor | None
    ok: torch.Tensor | None
    router_scores: torch.Tensor
    routed: torch.Tensor
    states: Mapping[int, Any]
    after: Mapping[int, Any]
    sure: torch.Tensor | None = None


@dataclass(frozen=True)
class Synced:
    """What the host learnt in the step's one synchronisation (plain values).

    Args:
        routed: the router's decision for each proposing row (``Proposal.rows``).
        delivered: per slot, the answer tokens that reached the host and are confirmed, in order, each as (token,
            counts as the LLM's, last the length limit allows): the token the previous step committed, or none —
            or, after speculation, the tokens the LLM confirmed (``rows.BatchRows.arrive``).
        failed: rows whose scores held no probability to draw from (their answer cannot go on).
        extra: the values the caller's stop rule asked to read (``turn.Stops.reads``).
        sure: per proposing row, whether the router's score reached ``WaitPolicy.speculate_below`` (empty: no row
            speculates).
    """

    routed: list[bool]
    delivered: list[list[tuple[int, bool, bool]]]
    failed: set[int]
    extra: list[int]
    sure: list[bool] = ()


@dataclass(frozen=True)
class StepResult:
    """What one step did.

    Args:
        plan: what it decided; synced: what the host read.
        token: [S] the token each slot committed (-1 where none; the pad for finished rows of a rectangle).
        routed: [S] bool, the router's decision on this step's proposals (False where nothing was proposed).
        router_scores: [S] the router's scores of this step's proposals (NaN where nothing was proposed).
        proposal: the proposals (their scores and logits: ``generate``'s output_scores/output_logits).
        llm_scores: [w, V] the LLM writers' processed scores; llm_logits: [r, V] the logits of the rows the LLM
            read (``plan.llm_reads``); None when the LLM did not run or resolved pending positions.
        settled: what the step committed where the LLM resolved pending positions (``plan.settle``), or None.
    """

    plan: StepPlan
    synced: Synced
    token: torch.Tensor
    routed: torch.Tensor
    router_scores: torch.Tensor
    proposal: Proposal
    llm_scores: torch.Tensor | None = None
    llm_logits: torch.Tensor | None = None
    settled: Settlement | None = None

    @property
    def writers(self) -> tuple[int, ...]:
        """Rows that committed a token in this step."""
        return self.plan.writers if self.settled is None else self.settled.writers


def _taken(values: torch.Tensor, index: torch.Tensor | None) -> torch.Tensor:
    return values if index is None else values[index.to(values.device)]


class DeviceStep(BatchRows):
    """The device side of a running batch's step (see the module docstring). ``RunningBatch`` provides what these
    read: ``pair``, ``layout``, ``choice``, ``counters``, ``device``, ``slm_logits``/``slm_hidden``, ``thresholds``,
    ``running``, ``last_token``, ``budget``, ``index`` and ``store_slm``."""

    def propose(self, speculate_below: float | None = None) -> Proposal:
        """Every proposing row's token, router score and routing decision (device values; nothing waits); where rows
        may speculate (``speculate_below``: the score from which a routed row waits instead), also each row's stream
        after its draw (a row that goes on past a routed position keeps it) and where its score reaches the bound."""
        speculate = speculate_below is not None
        rows = self.proposing()
        if not rows:
            nothing = torch.zeros(0, device=self.device)
            return Proposal(rows, None, None, None, None, None, nothing, nothing.bool(), {}, {}, None)
        index = self.index(rows)
        logits, hidden = _taken(self.slm_logits, index), _taken(self.slm_hidden, index)
        states = self.choice.state(rows)  # kept so the LLM can draw in the SLM's place
        scores, token, ok = self.choice.propose(logits, rows)
        after = self.choice.state(rows) if speculate else {}
        self.pair.router.step()
        router_scores = self.layout.route(logits, hidden, token).to(token.device)
        live = _taken(self.running, index)
        routed = (router_scores >= _taken(self.thresholds, index)) & live
        if self.budget is not None:
            budget_rows = None if index is None else index.to(self.budget.share.device)
            routed &= self.budget.allows(router_scores, budget_rows)
            self.budget.spend(router_scores, routed, live, budget_rows)
        sure = router_scores >= speculate_below if speculate else None
        return Proposal(rows, index, logits, scores, token, ok, router_scores, routed, states, after, sure)

    def sync(self, proposal: Proposal, extra: tuple[torch.Tensor, ...] = ()) -> Synced:
        """The step's one host synchronisation: this step's routing and draw flags, the previous step's tokens."""
        k, s, device = len(proposal.rows), len(self.rows), proposal.routed.device
        ok = proposal.ok
        failed_draws = (~ok).long() if ok is not None else proposal.routed.new_zeros(k, dtype=torch.long)
        flags = self.choice.flags()
        parts = [proposal.routed.long(), self.last_token.to(device), failed_draws.to(device)]
        parts.append(flags.long().to(device) if flags is not None else parts[0].new_zeros(0))
        parts += [value.reshape(-1).long().to(device) for value in extra]
        if proposal.sure is not None:
            parts.append(proposal.sure.long())
        flat = torch.cat(parts).tolist()
        self.counters.host_syncs += 1
        failed = {proposal.rows[i] for i, v in enumerate(flat[k + s : 2 * k + s]) if v}
        flagged = flat[2 * k + s : 2 * k + s + (s if flags is not None else 0)]
        failed |= {r for r, v in enumerate(flagged) if v}
        delivered = self.arrive(flat[k : k + s])
        rest = flat[2 * k + s + len(flagged):]
        extra, sure = (rest[:-k], [bool(v) for v in rest[-k:]]) if proposal.sure is not None and k else (rest, [])
        return Synced([bool(v) for v in flat[:k]], delivered, failed, extra, sure)

    def execute(self, proposal: Proposal, synced: Synced, plan: StepPlan) -> StepResult:
        """Run ``plan`` on the device (see the module docstring) and advance the rows' host state."""
        self.start_waiting(plan, proposal.states)
        slots = len(self.rows)
        committed = torch.full((slots,), -1, dtype=torch.long, device=self.device)
        routed = torch.zeros(slots, dtype=torch.bool, device=self.device)
        router_scores = torch.full((slots,), float("nan"), device=self.device)
        if proposal.rows:
            at = torch.arange(len(proposal.rows), device=self.device) if proposal.index is None else proposal.index
            committed[at], routed[at] = proposal.token, proposal.routed
            router_scores[at] = proposal.router_scores.float()
        llm_scores = llm_logits = settled = None
        if plan.resolving:  # speculation: the LLM confirms or corrects pending tokens (and writes the waiting rows)
            settled, committed = resolve(self, plan, committed)
        elif plan.llm_writers:  # the catch-up: the LLM reads what it has not read and writes in the SLM's place
            llm_logits = self.layout.llm_read(list(plan.llm_reads))
            states = {r: self.rows[r].rng for r in plan.llm_writers}
            llm_scores, token, ok = self.choice.redraw(llm_logits, list(plan.llm_reads), list(plan.llm_writers), states)
            writers = torch.tensor(plan.llm_writers, device=self.device)
            committed[writers] = token
            self.choice.flag(writers, ok)  # read in the next step's synchronisation
        writers = plan.writers if settled is None else settled.writers
        if set(plan.proposed) - set(writers):  # a routed row that waits, or one that ended, commits nothing
            wrote = torch.zeros(slots, dtype=torch.bool, device=self.device)
            wrote[torch.tensor(writers, dtype=torch.long, device=self.device)] = True
            committed = torch.where(wrote, committed, -1)
        if writers:  # (a rectangle commits the pad for its finished rows)
            committed = self.layout.append(list(writers), committed, self.running)
        self.last_token = committed
        reads = plan.slm_reads if settled is None else settled.slm_reads
        if reads:
            self.store_slm(list(reads), *self.layout.slm_read(list(reads)))
        self.log_budget(plan)
        self.advance(plan, settled, {r: (proposal.states.get(r), proposal.after.get(r)) for r in plan.speculating})
        self.counters.step(plan)
        return StepResult(plan, synced, committed, routed, router_scores, proposal, llm_scores, llm_logits, settled)
