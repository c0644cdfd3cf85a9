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

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from .plan import Settlement, StepPlan
from .rows import BatchRows
from .speculation import resolve
from .staging import staged


@dataclass(frozen=True)
class Proposal:
    """What the proposing rows offered, on the device.

    Where the rows' values sit: gathered by ``index``, a device index of ``rows`` (the tensors are [k], in the order
    of ``rows``), or, with ``index`` None, at their slots (the tensors cover every slot, [S]: gathering nothing,
    the step launches fewer kernels; a slot that did not propose holds values that are no proposal, and nothing
    reads them: its stream does not draw, its budget does not spend, the host reads the proposers' entries).

    Args:
        rows: the rows that proposed (slot order); index: see above.
        logits: the SLM's logits they proposed from; hidden: its hidden states.
        scores: the processed scores (the logits over the shared vocabulary themselves where no row processes
            them: greedy rows without processors); token: the proposals; ok: whether a draw had a probability to
            draw from (None: none can fail).
        router_scores: the router's scores; routed: where each row routes.
        states: each row's random stream before its draw (the LLM draws from there); after: after it (speculation).
        sure: where the router's score reaches ``WaitPolicy.speculate_below``, placed like routed (None: no row
            speculates).
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
        proposal: the proposals (their scores and logits: ``generate``'s output_scores/output_logits; ``routed`` and
            ``router_scores`` below place its routing at the slots, when asked).
        llm_scores: [w, V] the LLM writers' processed scores; llm_logits: [r, V] the logits of the rows the LLM
            read (``plan.llm_reads``); None when the LLM did not run or resolved pending positions.
        settled: what the step committed where the LLM resolved pending positions (``plan.settle``), or None.
    """

    plan: StepPlan
    synced: Synced
    token: torch.Tensor
    proposal: Proposal
    llm_scores: torch.Tensor | None = None
    llm_logits: torch.Tensor | None = None
    settled: Settlement | None = None

    @property
    def routed(self) -> torch.Tensor:
        """[S] bool, the router's decision on this step's proposals (False where nothing was proposed)."""
        return self._placed(self.proposal.routed, False)

    @property
    def router_scores(self) -> torch.Tensor:
        """[S] the router's scores of this step's proposals (NaN where nothing was proposed)."""
        return self._placed(self.proposal.router_scores.float(), float("nan"))

    def _placed(self, values: torch.Tensor, empty) -> torch.Tensor:
        """The proposers' ``values`` at their slots, ``empty`` elsewhere (computed when asked: the server does not)."""
        p, slots = self.proposal, len(self.token)
        if p.index is None and len(p.rows) == slots:  # every slot proposed (a rectangle's rows always do)
            return values
        out = torch.full((slots,), empty, dtype=values.dtype, device=self.token.device)
        if p.index is not None:
            return out.index_put((p.index.to(out.device),), values.to(out.device))
        at = staged(p.rows, out.device)
        return out.index_put((at,), values.to(out.device).index_select(0, at))

    @property
    def writers(self) -> tuple[int, ...]:
        """Rows that committed a token in this step."""
        return self.plan.writers if self.settled is None else self.settled.writers


def _taken(values: torch.Tensor, index: torch.Tensor | None) -> torch.Tensor:
    return values if index is None else values[index.to(values.device)]


class DeviceStep(BatchRows):
    """The device side of a running batch's step (see the module docstring). ``RunningBatch`` provides what these
    read: ``pair``, ``layout``, ``choice``, ``counters``, ``device``, ``slm_logits``/``slm_hidden``, ``thresholds``,
    ``running``, ``last_token``, ``budget``, ``index``, ``proposal_index``, ``mask``, ``budgeted`` and
    ``store_slm``."""

    def propose(self, speculate: bool = False, speculate_below: float = math.inf) -> Proposal:
        """Every proposing row's token, router score and routing decision (device values; nothing waits); where rows
        may ``speculate``, also each row's stream after its draw (a row that goes on past a routed position keeps it)
        and, where ``speculate_below`` bounds it, whether its score reaches the bound (it then waits instead)."""
        rows = self.proposing()
        if not rows:
            nothing = torch.zeros(0, device=self.device)
            return Proposal(rows, None, None, None, None, None, nothing, nothing.bool(), {}, {}, None)
        index = self.proposal_index(rows)
        logits, hidden = _taken(self.slm_logits, index), _taken(self.slm_hidden, index)
        states = self.choice.state(rows)  # kept so the LLM can draw in the SLM's place
        scores, token, ok = self.choice.propose(logits, rows, rows if index is None else None)
        after = self.choice.state(rows) if speculate else {}
        self.pair.router.step()
        if getattr(self.pair.router, "per_row", False):  # its draws are keyed by row and answer position
            self.pair.router.rows_scored([self.rows[r] for r in rows])
        router_scores = self.layout.route(logits, hidden, token).to(token.device)
        routed = router_scores >= _taken(self.thresholds, index)
        if self.layout.reads_every_row:  # a rectangle's finished rows route nothing (a slot's proposers all run)
            routed &= self.running
        if self.budget is not None and not self.budgeted.isdisjoint(rows):  # (rows without a budget spend none)
            live = _taken(self.running, index)
            budget_rows = None if index is None else index.to(self.budget.share.device)
            routed &= self.budget.allows(router_scores, budget_rows)
            self.budget.spend(router_scores, routed, live, budget_rows)
        sure = router_scores >= speculate_below if speculate and speculate_below < math.inf else None
        return Proposal(rows, index, logits, scores, token, ok, router_scores, routed, states, after, sure)

    def sync(self, proposal: Proposal, extra: tuple[torch.Tensor, ...] = ()) -> Synced:
        """The step's one host synchronisation: this step's routing and draw flags, the previous step's tokens."""
        n, s, device = len(proposal.routed), len(self.rows), proposal.routed.device
        at = proposal.rows if proposal.index is None else range(n)  # each proposing row's entry
        flags = self.choice.flags()
        parts = [proposal.routed, self.last_token.to(device)]  # (cat promotes bool to long: no cast kernel)
        parts += [part.reshape(-1).to(device) for part in (proposal.ok, flags, *extra) if part is not None]
        if proposal.sure is not None:
            parts.append(proposal.sure)  # last: n entries, like routed
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
        delivered = self.arrive(flat[n : n + s])
        stop = len(flat) - (n if proposal.sure is not None else 0)
        sure = [bool(flat[stop + i]) for i in at] if proposal.sure is not None else []
        return Synced([bool(flat[i]) for i in at], delivered, failed, flat[end:stop], sure)

    def execute(self, proposal: Proposal, synced: Synced, plan: StepPlan) -> StepResult:
        """Run ``plan`` on the device (see the module docstring) and advance the rows' host state."""
        self.start_waiting(plan, proposal.states)
        committed, holding = self._proposed(proposal)
        llm_scores = llm_logits = settled = None
        if plan.resolving:  # speculation: the LLM confirms or corrects pending tokens (and writes the waiting rows)
            settled, committed = resolve(self, plan, committed.clone())
        elif plan.llm_writers:  # the catch-up: the LLM reads what it has not read and writes in the SLM's place
            llm_logits = self.layout.llm_read(list(plan.llm_reads))
            states = {r: self.rows[r].rng for r in plan.llm_writers}
            llm_scores, token, ok = self.choice.redraw(llm_logits, list(plan.llm_reads), list(plan.llm_writers), states)
            writers = self.index(list(plan.llm_writers))
            committed = token if writers is None else committed.index_put((writers,), token)
            self.choice.flag(writers, ok)  # read in the next step's synchronisation
        writers = plan.writers if settled is None else settled.writers
        if holding - set(writers):  # a routed row that waits, one that ended, a slot that did not propose: nothing
            committed = torch.where(self.mask(writers), committed, -1)
        if writers:  # (a rectangle commits the pad for its finished rows)
            committed = self.layout.append(list(writers), committed, self.running)
        self.last_token = committed
        reads = plan.slm_reads if settled is None else settled.slm_reads
        if reads:
            self.store_slm(list(reads), *self.layout.slm_read(list(reads)))
        self.log_budget(plan)
        self.advance(plan, settled, {r: (proposal.states.get(r), proposal.after.get(r)) for r in plan.speculating})
        self.counters.step(plan)
        return StepResult(plan, synced, committed, proposal, llm_scores, llm_logits, settled)

    def _proposed(self, proposal: Proposal) -> tuple[torch.Tensor, set[int]]:
        """[S] this step's proposals at their slots, and the slots whose entry holds a token (a proposal, or what a
        slot that did not propose holds where the proposals cover every slot: ``Proposal.index``)."""
        slots = len(self.rows)
        if not proposal.rows:
            return torch.full((slots,), -1, dtype=torch.long, device=self.device), set()
        if proposal.index is None:
            return proposal.token, set(range(slots))
        empty = torch.full((slots,), -1, dtype=torch.long, device=self.device)
        return empty.index_put((proposal.index,), proposal.token), set(proposal.rows)
