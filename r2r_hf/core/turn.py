"""The schedule: one step of a running batch, and one turn of a loop that serves it.

A **step** (``decode_step``) reads top to bottom: the batch proposes on the device and reads what the host needs in
one synchronisation; ``plan.plan_step`` decides (the first decision); the LLM reads what the plan asks for;
``plan.settle`` decides what the step commits (the second: the plan as planned, unless the LLM rejected a pending
token); the batch commits it on the device; the ledger applies it on the host. The batch is a ``DeviceStep``: a
``RunningBatch``, or the cost model's replay, which prices each forward instead of running it (``step.py`` has the
values its stages hand each other). A **turn** is what a serving loop does between two looks at its queue: read one
piece of every prompt still being read (chunked prefill), take one step if any row decodes, and
free the slots of the rows whose answer ended. ``generate`` takes steps; the server's engine, the tests' driver and
the cost model's replay (``benchmarks/serving/cost_model.py``) take turns, the same function over the same plan.

A caller says when an answer ends through ``Stops``: the tokens the previous step committed reach the host in
this step's synchronisation, and the rows whose answer they end commit nothing more (no step computes a token
past an answer's end, and no host synchronisation is added). ``Stops`` only decides; what the caller tells its
clients it tells after the turn, from what its ``Stops`` recorded and the ``StepResult``.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from .counters import Counters
from .ledger import Applied, Ledger
from .plan import Outcome, StepPlan, plan_block, plan_moves, plan_step, settle
from .policy import WaitPolicy
from .staging import staged
from .step import LLMRead, Proposal, Synced


@dataclass(frozen=True)
class StepResult:
    """What one step did.

    Args:
        plan: what it decided first; outcome: what it committed (``plan.settle``); synced: what the host read.
        token: [S] the token each slot committed (-1 where none; the pad for finished rows of a rectangle).
        proposal: the proposals (their scores and logits: ``generate``'s output_scores/output_logits; ``routed`` and
            ``router_scores`` below place its routing at the slots, when asked).
        read: what the LLM's read found; applied: what the ledger changed (``ledger.Applied``).
    """

    plan: StepPlan
    outcome: Outcome
    synced: Synced
    token: torch.Tensor | None
    proposal: Proposal
    read: LLMRead
    applied: Applied

    @property
    def writers(self) -> tuple[int, ...]:
        """Rows that committed a token in this step."""
        return self.outcome.writers

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


class DeviceStep(Protocol):
    """The device side of a step (see the module docstring): a ``RunningBatch``, or the cost model's replay."""

    ledger: Ledger
    counters: Counters
    lockstep: bool  # the rows move together (HF's rectangle): ``plan.plan_step``'s and ``plan.settle``'s

    def propose(self, policy: WaitPolicy) -> Proposal:
        """Every proposing row's token, router score and routing decision (device values; nothing waits)."""

    def sync(self, proposal: Proposal, extra: tuple[torch.Tensor, ...] = ()) -> Synced:
        """The step's one host synchronisation: this step's routing and draw flags, the previous step's tokens."""

    def read_llm(self, plan: StepPlan, proposal: Proposal) -> LLMRead:
        """The LLM's read the plan asks for (a catch-up, or a resolution and its read-back), or ``LLMRead()``."""

    def commit(self, proposal: Proposal, plan: StepPlan, outcome: Outcome,
               read: LLMRead) -> tuple[torch.Tensor | None, Mapping[int, Any]]:
        """Roll back, commit and let the SLM read (see the module docstring); the token each slot committed [S],
        and each writer's random stream after it where the batch keeps streams (``Ledger.apply``)."""


class Stops(Protocol):
    """When a batch's answers end (see the module docstring)."""

    def reads(self) -> tuple[torch.Tensor, ...]:
        """Device values the check needs, read in the step's one synchronisation (``Synced.extra``)."""

    def ended(self, synced: Synced) -> dict[int, int]:
        """Rows whose answer ended with a token handed over now (``Synced.delivered``), each with how many of its
        delivered tokens the answer took (those after its end are not its own)."""


class NoStops:
    """Answers end only at their length limit (``RowState.max_new``)."""

    def reads(self) -> tuple[torch.Tensor, ...]:
        return ()

    def ended(self, synced: Synced) -> dict[int, int]:
        return {}


def decode_step(batch: DeviceStep, policy: WaitPolicy, stops: Stops = NoStops()) -> StepResult:
    """Advance ``batch`` (a ``RunningBatch``, or the cost model's replay) by one step (see the module docstring)."""
    ledger, lockstep = batch.ledger, batch.lockstep
    proposal = batch.propose(policy)  # device: choices, router, budget
    synced = batch.sync(proposal, stops.reads())  # the one host synchronisation
    ended = _delivered(batch.counters, stops.ended(synced), synced) | synced.failed
    plan = plan_step(ledger.rows, ledger.step_no, proposal.rows, synced.routed, ended, policy, lockstep, synced.sure,
                     synced.chance)
    read = batch.read_llm(plan, proposal)  # device: the catch-up, or a resolution and its read-back
    outcome = settle(ledger.rows, plan, read.rejected, lockstep)  # what the step commits
    token, streams = batch.commit(proposal, plan, outcome, read)  # device: rollbacks, commits, the SLM's read
    applied = ledger.apply(plan, outcome, proposal.states, proposal.after, streams,
                           dict(zip(proposal.rows, synced.chance)))
    batch.counters.step(plan, outcome)
    return StepResult(plan, outcome, synced, token, proposal, read, applied)


def _delivered(counters: Counters, taken: dict[int, int], synced: Synced) -> set[int]:
    """Count the tokens handed over (those past an answer's end, ``taken``, are not the answer's); the rows whose
    answer ended."""
    for r, tokens in enumerate(synced.delivered):
        if tokens:
            own = tokens[: taken.get(r, len(tokens))]
            counters.delivered(len(own), sum(by_llm for _, by_llm, _ in own))
    return set(taken)


def decode_block(batch, policy: WaitPolicy, stops: Stops = NoStops()) -> StepResult | None:
    """``policy.block`` steps drafted on the device in one block (``fast/drafts.py``, one host synchronisation),
    planned once (``plan.plan_block``), then each applied as ``decode_step`` applies a step, its plan made from the
    moves the device made (``plan.plan_moves``), the LLM not running (its turn comes at the next step); rows whose
    answer ends inside the block leave at once. The last step's result (its ``ended``: every row that ended in the
    block), or None where this turn cannot draft (``plan_block`` and ``RunningBatch.draft`` say where; nor where the
    stop rule reads the device)."""
    ledger = batch.ledger
    block = None if stops.reads() or not hasattr(batch, "draft") else plan_block(ledger, policy)
    drafted = None if block is None else batch.draft(block)
    if drafted is None:
        return None
    ended_all, result, done = set(), None, 0
    for i, made in enumerate(drafted.moves):
        moves = {r: m for r, m in made.items() if ledger.rows[r] is not None}  # (rows that ended in the block left)
        rows = list(moves)
        if not rows:
            break
        routed, sure = [drafted.routed[i][r] for r in rows], [drafted.sure[i][r] for r in rows]
        synced = Synced(routed, ledger.arrive(drafted.arrived(i)), set(), [], sure)
        ended = _delivered(batch.counters, stops.ended(synced), synced)
        plan = plan_moves(ledger.rows, ledger.step_no, rows, ended, moves)
        outcome = settle(ledger.rows, plan, {}, False)
        applied = ledger.apply(plan, outcome, chances=drafted.chances(i) if policy.draft_cost else {})
        batch.counters.step(plan, outcome)
        batch.leave(list(plan.ended))
        ended_all |= set(plan.ended)
        proposal = _drafted_proposal(rows, routed)
        result, done = StepResult(plan, outcome, synced, None, proposal, LLMRead(), applied), i + 1
    # what the last step the host applied committed reaches it at the next step (not what the device drafted after
    # it for rows that ended: they left)
    batch.delivers([t if ledger.rows[r] is not None else -1 for r, t in enumerate(drafted.arrived(done))])
    return dataclasses.replace(result, plan=dataclasses.replace(result.plan, ended=tuple(sorted(ended_all))))


def _drafted_proposal(rows: list[int], routed: list[bool]) -> Proposal:
    """A drafted step's proposal as the host knows it: its rows and where they routed (the tokens, scores and
    logits stayed on the device)."""
    flags = torch.tensor(routed, dtype=torch.bool)
    return Proposal(rows, torch.arange(len(rows)), None, None, None, None, torch.full((len(rows),), math.nan),
                    flags, {}, {})


def turn(batch, policy: WaitPolicy, stops: Stops = NoStops(), prefill: int | None = None) -> StepResult | None:
    """One turn of a serving loop over ``batch``: a piece of at most ``prefill`` tokens of every prompt still being
    read, one step (or a draft block of ``policy.block`` steps: ``decode_block``) if any row decodes, then the rows
    whose answer ended leave. The (last) step's result, or None."""
    if batch.ledger.prefilling():
        batch.prefill(prefill)
    if not batch.ledger.decoding():
        return None
    result = decode_block(batch, policy, stops) or decode_step(batch, policy, stops)
    batch.leave(list(result.plan.ended))
    return result
