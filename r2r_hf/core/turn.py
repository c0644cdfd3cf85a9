"""The schedule: one step of a running batch, and one turn of a loop that serves it.

A **step** proposes on the device, reads what the host needs in one synchronisation, plans over host values and
executes the plan (``step.py``, ``plan.py``). A **turn** is what a serving loop does between two looks at its
queue: read one piece of every prompt still being read (chunked prefill), take one step if any row decodes, and
free the slots of the rows whose answer ended. ``generate`` takes steps; the server's engine, the tests' driver and
the cost model's replay (``benchmarks/serve_model.py``) take turns, the same function over the same plan.

A caller says when an answer ends through ``Stops``: the tokens the previous step committed reach the host in
this step's synchronisation, and the rows whose answer they end commit nothing more (no step computes a token
past an answer's end, and no host synchronisation is added). ``Stops`` only decides; what the caller tells its
clients it tells after the turn, from what its ``Stops`` recorded and the ``StepResult``.
"""

from __future__ import annotations

from typing import Protocol

import torch

from .plan import plan_step
from .policy import WaitPolicy
from .step import StepResult, Synced


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


def decode_step(batch, policy: WaitPolicy, stops: Stops = NoStops()) -> StepResult:
    """Advance ``batch`` (a ``RunningBatch``, or anything with its step interface) by one step."""
    proposal = batch.propose(policy.speculate > 0, policy.speculate_below)  # device: choices, router, budget
    synced = batch.sync(proposal, stops.reads())  # the one host synchronisation (more where the LLM resolves)
    taken = stops.ended(synced)
    for r, kept in taken.items():  # tokens handed over past an answer's end are not the answer's
        surplus = synced.delivered[r][kept:]
        batch.counters.delivered(-len(surplus), -sum(by_llm for _, by_llm, _ in surplus))
    ended = set(taken) | synced.failed
    rectangle = batch.layout.reads_every_row  # HF's rectangle: its rows cannot wait, its LLM reads every row
    plan = plan_step(batch.rows, batch.step_no, proposal.rows, synced.routed, ended, policy, rectangle, not rectangle,
                     synced.sure)
    return batch.execute(proposal, synced, plan)  # device: catch-up, commit, SLM read; then the rows' host state


def turn(batch, policy: WaitPolicy, stops: Stops = NoStops(), prefill: int | None = None) -> StepResult | None:
    """One turn of a serving loop over ``batch``: a piece of at most ``prefill`` tokens of every prompt still being
    read, one step if any row decodes, then the rows whose answer ended leave. The step's result, or None."""
    if batch.prefilling():
        batch.prefill(prefill)
    if not batch.decoding():
        return None
    result = decode_step(batch, policy, stops)
    batch.leave(list(result.plan.ended))
    return result
