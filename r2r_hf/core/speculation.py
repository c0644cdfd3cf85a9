"""Speculative routing: a routed row goes on with the SLM's token, and one shared LLM forward later confirms it
or corrects it and cuts the row back. Answers are R2R's, token for token.

Where the router routes, the LLM's token is usually the SLM's own proposal (87.6 % of routed positions on the
shipped pair: ``../shared`` notes, docs/performance.md). A row that may speculate (``WaitPolicy.speculate``) keeps
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
writes again what it wrote (greedy: the same tokens). Clients see confirmed tokens only (``rows.BatchRows.arrive``).

``resolve`` is the device side of a step in which the LLM resolves pending positions; ``plan.settle`` decides
what the step commits from what it found.
"""

from __future__ import annotations

import torch

from .plan import Settlement, StepPlan, settle
from .staging import staged


def resolve(batch, plan: StepPlan, committed: torch.Tensor) -> tuple[Settlement, torch.Tensor]:
    """The LLM reads what resolving ``plan.resolving`` and writing ``plan.llm_writers`` needs, confirms or rejects
    each pending position, and the batch is cut back where it rejected one; the settlement, and ``committed`` [S]
    with this step's LLM tokens (and a rectangle's kept ones) in place."""
    rows, layout, choice = batch.rows, batch.layout, batch.choice
    pending = {r: list(rows[r].pending) for r in plan.resolving}
    needs = {r: [p.index for p in ps] for r, ps in pending.items()}
    for r in plan.llm_writers:
        needs.setdefault(r, []).append(rows[r].written)
    predicted = layout.predict(needs)
    indices = {r: found[0] for r, found in predicted.items()}
    logits = {r: found[1] for r, found in predicted.items()}
    verified = choice.verify(logits, indices, pending)
    drawn = _written(batch, plan, indices, logits)
    rejected = _first_rejections(layout, pending, verified, batch.device)
    batch.counters.host_syncs += 1  # (the resolution's own: which rows to cut back decides what the step commits)
    settled = settle(rows, plan, rejected, cuts_together=layout.reads_every_row)
    for r, index in settled.rollbacks.items():
        batch.restore_budget(r, rows[r].tail[index - rows[r].confirmed][0])
        layout.cut(r, index)
    for r, j in rejected.items():
        if j is not None:
            choice.restore(r, verified[r][2][j])  # the stream after the LLM's draw at the rejected position
    for r in settled.llm_writers:
        committed[r] = verified[r][0][rejected[r]] if rejected.get(r) is not None else drawn[r]
    for r in settled.kept:
        committed[r] = layout.tokens_at(r, [settled.rollbacks[r]])[0]
    thrown = sum(rows[r].written - i - (r in settled.kept) for r, i in settled.rollbacks.items())
    batch.counters.resolved(settled.agreed, settled.rejected, thrown)
    return settled, committed


def _written(batch, plan: StepPlan, indices: dict, logits: dict) -> dict[int, torch.Tensor]:
    """The LLM's token for each row it writes where the row waits (drawn as without speculation)."""
    rows, writers = batch.rows, list(plan.llm_writers)
    if not writers:
        return {}
    drawing = list(range(len(rows))) if batch.layout.reads_every_row else writers
    last = torch.stack([logits[r][indices[r].index(rows[r].written)] for r in drawing])
    states = {r: rows[r].rng for r in writers}
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
