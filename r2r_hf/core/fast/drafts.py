"""Draft blocks: k SLM steps of every slot in one captured step, read back once (issue 49, multi-step drafts).

A served step waits on the device once (``turn.decode_step``): the host reads the routing back, plans, and only
then queues the next step, so the device idles for the host's decisions at every token. Where every proposing row
proposes the SLM's argmax with the router folded into the SLM's read (greedy rows without processors or a budget),
nothing a step decides needs the host until the LLM runs: a routed row waits for it, or, speculating, goes on with
the SLM's token while it may hold more pending positions and the router is not sure (``plan.plan_step``'s rule). A draft block applies that rule on the device for k steps — propose (the argmax), route (the folded
scores), commit (a row that waits stops drafting; one whose length limit is reached stops), the SLM's read of every
slot's new token — and the host reads the k steps' tokens and flags back in one synchronisation, then plans and
applies each step as it would have (``core/blocks.py``), the LLM not running inside a block.

What the device cannot know it does not need to: a row whose answer a stop rule ends inside the block (an EOS, a stop
string) goes on drafting there; the host ends it at the step it ends and its slot is freed, the tokens drafted past
its end with it (as a speculative tail past an end is).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ..staging import staged
from ..step import Drafted
from .fused import attended
from .graphs import Step


def draft_fn(read: Callable[..., tuple], k: int, vocab: int, trash: int, tokens: torch.Tensor) -> Step:
    """The block's step function: ``read`` (ids, position, column, real [S, 1]) -> (logits [S, V], hidden [S, H],
    folded scores [S]) is the SLM's read of every slot, run after each of the ``k`` drafted steps; ``tokens`` [S, C]
    is the slots' token buffer the drafted tokens are written into (in place). Returns, per drafted step [k, S], the
    argmax proposals, where they routed, where the router was sure, where they were committed and which rows
    proposed; then each slot's SLM outputs after its last committed token (logits, hidden, folded scores)."""

    def draft(logits, hidden, scores, thresholds, below, depth, pending, active, remaining, lengths):
        drafted, routed_at, sure_at, committed_at, active_at = [], [], [], [], []
        rows = torch.arange(len(lengths), device=lengths.device)
        for _ in range(k):
            token = logits[:, :vocab].argmax(-1)
            routed, sure = scores >= thresholds, scores >= below
            commit = active & (~routed | ((pending < depth) & ~sure))
            active_at.append(active)
            drafted.append(token)
            routed_at.append(routed)
            sure_at.append(sure)
            committed_at.append(commit)
            at = lengths.clamp(max=tokens.shape[1] - 1)
            tokens[rows, at] = torch.where(commit, token, tokens[rows, at])
            pending = pending + (commit & routed).long()
            remaining = remaining - commit.long()
            active = commit & (remaining > 0)  # a row that waits for the LLM, or drained, drafts no more
            column = torch.where(commit, lengths, trash)
            logits_new, hidden_new, scores_new = read(ids=token[:, None], position=torch.where(commit, lengths, 0)[:, None],
                                                      column=column[:, None], real=commit[:, None])
            lengths = lengths + commit.long()
            logits = torch.where(commit[:, None], logits_new, logits)
            hidden = torch.where(commit[:, None], hidden_new.to(hidden.dtype), hidden)
            scores = torch.where(commit, scores_new.to(scores.dtype), scores)
        stack = lambda values: torch.stack(values)  # noqa: E731  [k, S]
        return (stack(drafted), stack(routed_at), stack(sure_at), stack(committed_at), stack(active_at), logits,
                hidden, scores)

    return draft


class CapturedDrafts:
    """Draft blocks of ``k`` steps over every slot, captured per columns attended (``fused.attended``) with
    ``capture``; ``reads`` gives the SLM's (uncaptured, folded) read function of every slot at a span."""

    def __init__(self, reads: Callable[[int], Callable], capture: Callable[[Step, dict], Step], k: int, vocab: int,
                 trash: int, tokens: torch.Tensor) -> None:
        self.reads, self.capture, self.k, self.vocab, self.trash, self.tokens = reads, capture, k, vocab, trash, tokens
        self.steps: dict[int, Step] = {}

    def run(self, filled: int, **inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """One block over slots whose tokens, the block's included, fill at most ``filled`` columns (its attention
        span: ``fused.attended``); captured on first use."""
        span = attended(filled, self.trash)
        if span not in self.steps:
            fn = draft_fn(self.reads(span), self.k, self.vocab, self.trash, self.tokens)
            idle = {**inputs, "active": torch.zeros_like(inputs["active"])}  # capture writes nothing
            self.steps[span] = self.capture(fn, idle)
        return self.steps[span](**inputs)

    def warm(self, spans: tuple[int, ...], example: dict[str, torch.Tensor]) -> int:
        """Capture a block per span (``spans``), largest first, with inputs that write nothing."""
        for span in reversed(spans):
            self.run(span, **{**example, "active": torch.zeros_like(example["active"])})
        return len(self.steps)


def block_inputs(ledger, rows: list[int], lengths: list[int], policy, device: torch.device) -> dict[str, torch.Tensor]:
    """The block's drafting state of every slot, from the host (one staged copy): pending positions held, whether it
    proposes (``rows``), tokens it may still commit, its length; the policy's depth and bound."""
    slots = len(ledger.rows)
    chosen = set(rows)
    host = [[len(row.pending) if row else 0 for row in ledger.rows], [int(r in chosen) for r in range(slots)],
            [row.max_new if row else 0 for row in ledger.rows], list(lengths)]
    pending, active, remaining, length = staged(host, device).unbind(0)
    return {"pending": pending, "active": active.bool(), "remaining": remaining, "lengths": length,
            "below": torch.tensor(policy.speculate_below, device=device),
            "depth": torch.tensor(policy.speculate, device=device)}


def read_back(previous: torch.Tensor, drafted: tuple[torch.Tensor, ...]) -> Drafted:
    """The block's one host synchronisation: the tokens committed before it (``previous`` [S]) and its proposals,
    routing, sure, committed and proposing flags [k, S]."""
    flat = torch.cat([previous.to(drafted[0].device), *(part.flatten().long() for part in drafted)]).tolist()
    slots, steps = len(previous), drafted[0].shape[0]
    parts = [[flat[slots + (j * steps + i) * slots: slots + (j * steps + i + 1) * slots] for i in range(steps)]
             for j in range(len(drafted))]
    return Drafted(flat[:slots], parts[0], *([[bool(v) for v in step] for step in part] for part in parts[1:]))
