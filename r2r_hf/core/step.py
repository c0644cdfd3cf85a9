"""The device side of one step: the values its stages hand each other.

``turn.decode_step`` runs a step top to bottom; a ``turn.DeviceStep`` (the ``RunningBatch``, or the cost model's
replay, which prices each forward instead of running it) does the device work between the two decisions:

1. ``propose``   every row that is not waiting proposes its next token from the SLM's logits, through its
                 processors and its random stream (``choice.py``); the router scores the proposals; a row routes
                 where its score reaches its threshold and its budget allows (``budget.py``). Nothing waits.
2. ``sync``      the step's one host synchronisation: the routing decisions, the tokens the previous step committed
                 (the server decodes and stops on them one step late, so the host never waits twice), and whatever
                 the caller's stop rule needs (``turn.Stops``). Then ``plan.plan_step`` decides.
3. ``read_llm``  where the plan runs the LLM: its catch-up (it reads every token it has not read of the rows it
                 reads and draws its writers' tokens from where each row's SLM draw started), or a resolution
                 (``speculation.resolve``: it also judges every pending position, and reads back where it rejected
                 one). Then ``plan.settle`` decides what the step commits.
4. ``commit``    the outcome: rows cut back where a pending token was rejected (``speculation.roll_back``), each
                 writer commits its token, the SLM reads the committed tokens of the rows that propose again.

After it the ledger applies the step (``ledger.Ledger.apply``).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

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
        sure: where a routed row waits rather than speculate: the router's score reaches
            ``WaitPolicy.speculate_below`` or the SLM's probability of its token is under ``draft_confidence``;
            placed like routed (None: no row speculates, or neither bound applies).
        chance: the SLM's probability of each proposal in ``staging.CHANCE_UNIT``s where the policy ends drafts by
            the expected-gain rule (``WaitPolicy.draft_cost``), placed like routed; None: it does not.
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
    chance: torch.Tensor | None = None


@dataclass(frozen=True)
class Synced:
    """What the host learnt in the step's one synchronisation (plain values).

    Args:
        routed: the router's decision for each proposing row (``Proposal.rows``).
        delivered: per slot, the answer tokens that reached the host and are confirmed, in order, each as (token,
            counts as the LLM's, last the length limit allows): the token the previous step committed, or none —
            or, after speculation, the tokens the LLM confirmed (``ledger.Ledger.arrive``).
        failed: rows whose scores held no probability to draw from (their answer cannot go on).
        extra: the values the caller's stop rule asked to read (``turn.Stops.reads``).
        sure: per proposing row, whether it waits rather than speculate where it routes (``Proposal.sure``; empty:
            no row speculates).
        chance: per proposing row, the SLM's probability of its token (``Proposal.chance``; empty: not read).
    """

    routed: list[bool]
    delivered: list[list[tuple[int, bool, bool]]]
    failed: set[int]
    extra: list[int]
    sure: list[bool] = ()
    chance: list[float] = ()


@dataclass(frozen=True)
class LLMRead:
    """What the step's LLM read found (``LLMRead()``: the LLM did not run).

    Args:
        rows: the rows it drew a token for, in slot order: its writers, and in a resolution the rows it rejected a
            pending token of; tokens: [len(rows)] those tokens (on the device); index: ``rows`` as a device index
            (None: every slot, in order).
        rejected: per resolving row, the position in its pending list of the first token the LLM did not confirm
            (None: it confirmed all) — ``plan.settle``'s input.
        streams: per rejected row, its random stream after the LLM's draw there (a rollback restores it).
        scores: [w, V] the catch-up's processed scores of its writers; logits: [r, V] the logits of the rows it read
            (``plan.llm_reads``): ``generate``'s output_scores/output_logits (None in a resolution).
    """

    rows: tuple[int, ...] = ()
    tokens: torch.Tensor | None = None
    index: torch.Tensor | None = None
    rejected: Mapping[int, int | None] = field(default_factory=dict)
    streams: Mapping[int, Any] = field(default_factory=dict)
    scores: torch.Tensor | None = None
    logits: torch.Tensor | None = None

    def tokens_of(self, rows: tuple[int, ...]) -> torch.Tensor:
        """[len(rows)] the tokens drawn for ``rows`` (a subset of ``self.rows``, in order)."""
        if rows == self.rows:
            return self.tokens
        at = staged([self.rows.index(r) for r in rows], self.tokens.device)
        return self.tokens.index_select(0, at)
