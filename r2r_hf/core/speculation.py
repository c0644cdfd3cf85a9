"""Speculative routing: a routed row goes on with the SLM's token, and one shared LLM forward later confirms it
or corrects it and cuts the row back. Answers are R2R's, token for token.

Where the router routes, the LLM's token is usually the SLM's own proposal (87.6 % of routed positions on the
shipped pair: benchmarks/results/speculation.md). A row that may speculate (``WaitPolicy.speculate``) keeps
the SLM's token at a routed position, *pending*, and goes on. When the LLM runs (``plan.plan_step``), it reads each
resolving row up to its last pending position in one forward and gives its logits at every pending position.
There, per row and in order, the LLM's token is chosen as R2R would have chosen it — through the row's processors
over the same prefix, drawn from the row's stream as it stood before the SLM's draw — and the position is
confirmed only if that token is the SLM's **and** the stream after the LLM's draw stands where it stood after the
SLM's (a draw need not advance a stream by a fixed amount: the states are compared). At the first position where
either differs, the LLM's token is committed there, everything after it is thrown away (both models' caches cut
back, the budget and the stream restored to that position) and the row goes on from the LLM's token. Every
token past a confirmed prefix is then exactly what R2R writes. A row's rollback touches no other row, except in
HF's rectangle, whose rows share one length: there every row is cut back to the earliest rejected position and
writes again what it wrote (greedy: the same tokens). Clients see confirmed tokens only (``ledger.Ledger.arrive``).

Words: a token is *pending* where its row went past a routed position with the SLM's token, *confirmed* once no
rollback can take it back (before a row's first pending position), *settled* once the LLM has judged it; a
*rollback* cuts a row back to a rejected position: both caches, its budget and its random stream.

``resolve`` is the LLM's read of a step in which it judges pending positions; ``plan.settle`` decides what the step
commits from what it found; ``roll_back`` is the device side of the rollbacks it decided.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch

from .plan import Outcome, StepPlan
from .policy import WaitPolicy
from .staging import staged
from .step import LLMRead, Proposal


def resolve(batch, plan: StepPlan, proposal: Proposal) -> LLMRead:
    """The LLM reads what judging ``plan.resolving``'s pending positions and writing ``plan.llm_writers`` needs, in
    one read; per resolving row the first position it rejects (read back in one host synchronisation), and the
    tokens it draws: at each row's rejected position, and for each writer that waited."""
    rows, layout = batch.ledger.rows, batch.layout
    pending = {r: list(rows[r].pending) for r in plan.resolving}
    needs = {r: [p.index for p in ps] for r, ps in pending.items()}
    for r in plan.llm_writers:
        needs.setdefault(r, []).append(rows[r].written)
    layout.keep("llm", list(plan.resolving))  # its state before it reads a pending token (a rollback returns there)
    predicted = layout.predict(needs)
    indices = {r: found[0] for r, found in predicted.items()}
    logits = {r: found[1] for r, found in predicted.items()}
    verified = batch.choice.verify(logits, indices, pending)
    drawn = _written(batch, plan, proposal, indices, logits)
    rejected = _first_rejections(layout, pending, verified, batch.device)
    batch.counters.host_syncs += 1  # (the resolution's own: which rows to cut back decides what the step commits)
    at = {r: j for r, j in rejected.items() if j is not None}
    drawn.update({r: verified[r][0][j] for r, j in at.items()})
    streams = {r: verified[r][2][j] for r, j in at.items()}  # each stream after the LLM's draw where it rejected
    order = tuple(sorted(drawn))
    tokens = torch.stack([drawn[r] for r in order]) if order else None
    return LLMRead(order, tokens, batch.index(list(order)) if order else None, rejected, streams)


def roll_back(batch, outcome: Outcome, streams: Mapping[int, Any]) -> None:
    """The device side of ``outcome``'s rollbacks, in one place: each row's caches cut back to its rollback index,
    its budget restored to where it stood after the step that committed the token there, and each rejected row's
    random stream to after the LLM's draw at its rejected position (``streams``)."""
    for r, index in outcome.rollbacks.items():
        if batch.budget is not None:
            batch.budget.restore(r, batch.ledger.step_of(r, index))
        batch.layout.cut(r, index)
    for r, state in streams.items():
        batch.choice.restore(r, state)


def _written(batch, plan: StepPlan, proposal: Proposal, indices: dict, logits: dict) -> dict[int, torch.Tensor]:
    """The LLM's token for each row it writes where the row waits (drawn as without speculation)."""
    ledger, writers = batch.ledger, list(plan.llm_writers)
    if not writers:
        return {}
    rows = ledger.rows
    drawing = list(range(len(rows))) if batch.lockstep else writers
    last = torch.stack([logits[r][indices[r].index(rows[r].written)] for r in drawing])
    states = {r: ledger.stream_before(r, proposal.states) for r in writers}
    _, tokens, ok = batch.choice.redraw(last, drawing, writers, states)
    batch.choice.flag(staged(writers, tokens.device), ok)
    return dict(zip(writers, tokens))


def _first_rejections(layout, pending: dict, verified: dict, device: torch.device) -> dict[int, int | None]:
    """Per resolving row, the position in its pending list of the first token the LLM does not confirm (None:
    every one confirmed), read in one host synchronisation for the whole batch."""
    rows = sorted(pending)
    agree = [verified[r][0].to(device) == layout.tokens_at(r, [p.index for p in pending[r]]).to(device) for r in rows]
    flat = torch.cat(agree).tolist() if agree else []
    out, at = {}, 0
    for r in rows:
        n = len(pending[r])
        same = [a and s for a, s in zip(flat[at : at + n], verified[r][1])]
        out[r] = next((j for j, ok in enumerate(same) if not ok), None)
        at += n
    return out


def waits(policy: WaitPolicy, router_scores: torch.Tensor, chance: torch.Tensor | None,
          thresholds: torch.Tensor) -> torch.Tensor | None:
    """Where a routed row waits rather than speculate (``Proposal.sure``): the router is surer than
    ``speculate_below`` (not where a row's threshold, ``thresholds``, routes every position: there the router's score
    decides nothing, as where it does not run), or the SLM's probability of its token (``chance``: ``chances``) is
    under ``draft_confidence``; None: neither bound. (Where a draft ends by the expected-gain rule the host decides:
    it knows the row's tail, ``plan.plan_step``.)"""
    sure = None
    if policy.speculate_below < math.inf:
        sure = (router_scores >= policy.speculate_below) & (thresholds.to(router_scores.device) > 0)
    if policy.draft_confidence > 0:
        unsure = (chance < policy.draft_confidence).to(router_scores.device)
        sure = unsure if sure is None else sure | unsure
    return sure


def chances(policy: WaitPolicy, scores: torch.Tensor, token: torch.Tensor) -> torch.Tensor | None:
    """The SLM's probability of each proposal (``scores`` [n, V] its scores, ``token`` [n]) where the policy reads
    it (``draft_confidence``, ``draft_cost``); None: nowhere."""
    if not (policy.draft_confidence > 0 or policy.draft_cost > 0):
        return None
    return scores.float().softmax(-1).gather(-1, token[:, None].to(scores.device))[:, 0]
