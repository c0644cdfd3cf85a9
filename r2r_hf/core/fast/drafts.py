"""Draft blocks: k SLM steps of every slot in one captured step, read back once (issue 49, multi-step drafts).

A served step waits on the device once (``turn.decode_step``): the host reads the routing back, plans, and only
then queues the next step, so the device idles for the host's decisions at every token. Where every proposing row
proposes the SLM's argmax with the router folded into the SLM's read (greedy rows without processors or a budget),
nothing a step decides needs the host until the LLM runs: a routed row waits for it, or, speculating, goes on with
the SLM's token while it may hold more pending positions (its depth), the router is not sure and no token of its tail
the host has seen ends its answer; a row that routes everywhere (threshold 0) and fills its depth commits its last
pending token unread, its next token being the LLM's (each row's move: ``moves.move``). A draft block, planned once
on the host (``moves.BlockPlan``), applies that rule on the device for k steps — propose (the argmax), route (the
folded scores), each row's move (``device_move``: a row that waits stops drafting; one whose length limit is reached
stops), the SLM's read of every slot's new token — and the host reads the k steps' tokens and moves back in one
synchronisation, then applies each step's moves as it applies a step's (``turn.decode_block``), the LLM not running
inside a block. ``device_move`` is ``moves.move``'s device form: ``tests/test_moves.py`` holds the two equal on one
table of cases, and a whole block to ``moves.draft_on_host``.

What the device cannot know it does not need to: a row whose answer a stop rule ends inside the block (an EOS, a stop
string) goes on drafting there; the host ends it at the step it ends and its slot is freed, the tokens drafted past
its end with it (as a speculative tail past an end is).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ..moves import BlockPlan, Drafted, Move, Standing
from ..staging import CHANCE_UNIT, in_units, staged
from .fused import attended
from .graphs import Step


ENDS = 8  # end tokens a drafted row may have at most (more: the batch does not draft; ``RunningBatch.draft``)


def device_move(routed: torch.Tensor, sure: torch.Tensor, pending: torch.Tensor, depth: torch.Tensor,
                left: torch.Tensor, everywhere: torch.Tensor, ended: torch.Tensor,
                active: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``moves.move`` on the device, for every slot at once (``Standing``'s fields [S]; ``active``: the slot
    proposes): where each row commits a token (it writes, speculates or takes its frontier), and where that token is
    its frontier's (``Move.of`` reads the move back)."""
    last = everywhere & (left > 1)  # (a row that routes everywhere ends its draft with its frontier)
    commit = active & (~routed | ((pending < depth) & ~ended & (~sure | last)))
    frontier = commit & routed & last & ((pending + 1 >= depth) | sure)
    return commit, frontier


def device_draft_ends(chance: torch.Tensor, expected: torch.Tensor, pending: torch.Tensor, everywhere: torch.Tensor,
                      cost: torch.Tensor, proposal: torch.Tensor) -> torch.Tensor:
    """``moves.draft_ends`` on the device, for every slot at once (``Standing``'s fields [S], float64 as the host's
    floats; ``proposal``: the SLM's probability of each slot's proposal): where a row's draft ends with it."""
    q = chance * proposal
    return (cost > 0) & everywhere & (q * (pending + 1 + cost) < expected + q)


def draft_fn(read: Callable[..., tuple], k: int, vocab: int, trash: int, tokens: torch.Tensor,
             gains: bool = False) -> Step:
    """The block's step function: ``read`` (ids, position, column, real [S, 1]) -> (logits [S, V], hidden [S, H],
    folded scores [S]) is the SLM's read of every slot, run after each of the ``k`` drafted steps; ``tokens`` [S, C]
    is the slots' token buffer the drafted tokens are written into (in place); ``gains``: rows may end drafts by the
    expected-gain rule (``WaitPolicy.draft_cost``; without it the block leaves its kernels out and reads back no
    probabilities: zeros). Returns, per drafted step [k, S], the argmax proposals, where they routed, where they were
    sure (the router, or where a draft ended), where they were committed, which rows proposed, where the SLM read
    the committed token and the SLM's probability of each proposal (in ``staging.CHANCE_UNIT``s); then each slot's
    SLM outputs after its last read token (logits, hidden, folded scores)."""

    def draft(logits, hidden, scores, thresholds, below, confidence, depth, pending, active, remaining, lengths,
              everywhere, ends, ended, previous, chance, expected, cost):
        steps = {name: [] for name in ("token", "routed", "sure", "commit", "active", "read", "chance")}
        rows = torch.arange(len(lengths), device=lengths.device)
        unread = None if gains else torch.zeros_like(lengths)  # (the probabilities read back without the rule)
        ended = ended | ((pending > 0) & (previous[:, None] == ends).any(-1))  # the host sees it at the first step
        for _ in range(k):
            token = logits[:, :vocab].argmax(-1)
            routed, sure = scores >= thresholds, (scores >= below) & ~everywhere  # (fixed routing: never sure)
            top = logits[:, :vocab].float().softmax(-1).amax(-1)  # the SLM's probability of its argmax
            sure = sure | (top < confidence)  # the SLM unsure: it ends
            units = in_units(top) if gains else unread
            if gains:
                proposal = units.double() / CHANCE_UNIT
                sure = sure | (routed & device_draft_ends(chance, expected, pending, everywhere, cost, proposal))
            commit, frontier = device_move(routed, sure, pending, depth, remaining, everywhere, ended, active)
            at = lengths.clamp(max=tokens.shape[1] - 1)
            tokens[rows, at] = torch.where(commit, token, tokens[rows, at])
            held = commit & routed  # where each row stands after its move (``Standing.after``)
            pending = pending + held.long()
            if gains:
                kept = chance * proposal
                chance, expected = torch.where(held, kept, chance), torch.where(held, expected + kept, expected)
            remaining = remaining - commit.long()
            reads = commit & ~frontier
            for name, value in zip(steps, (token, routed, sure, commit, active, reads, units)):
                steps[name].append(value)
            ended = ended | (commit & (pending > 0) & (token[:, None] == ends).any(-1))  # seen at the next step
            active = reads & (remaining > 0)  # a row that waits for the LLM, or drained, drafts no more
            column = torch.where(reads, lengths, trash)
            logits_new, hidden_new, scores_new = read(ids=token[:, None], position=torch.where(reads, lengths, 0)[:, None],
                                                      column=column[:, None], real=reads[:, None])
            lengths = lengths + commit.long()
            logits = torch.where(reads[:, None], logits_new, logits)
            hidden = torch.where(reads[:, None], hidden_new.to(hidden.dtype), hidden)
            scores = torch.where(reads, scores_new.to(scores.dtype), scores)
        return (*(torch.stack(values) for values in steps.values()), logits, hidden, scores)

    return draft


class CapturedDrafts:
    """Draft blocks of ``k`` steps over every slot, captured per columns attended (``fused.attended``) with
    ``capture``; ``reads`` gives the SLM's (uncaptured, folded) read function of every slot at a span."""

    def __init__(self, reads: Callable[[int], Callable], capture: Callable[[Step, dict], Step], k: int, vocab: int,
                 trash: int, tokens: torch.Tensor, gains: bool = False) -> None:
        self.reads, self.capture, self.k, self.vocab, self.trash, self.tokens = reads, capture, k, vocab, trash, tokens
        self.gains = gains
        self.steps: dict[int, Step] = {}

    def run(self, plan: BlockPlan, lengths: list[int], **outputs: torch.Tensor) -> tuple[Drafted, tuple]:
        """``plan``'s block over slots of ``lengths`` tokens (its attention span: the columns they fill with the
        block's, ``fused.attended``) from each slot's SLM outputs, threshold and last token (``outputs``: ``inputs``),
        read back once: what it drafted, and each slot's SLM outputs after it (device values)."""
        if not self.gains and any(st is not None and st.cost > 0 for st in plan.standing):
            raise RuntimeError("these draft blocks were captured without the expected-gain rule its rows ask for "
                               "(WaitPolicy.draft_cost); capture them with gains=True (capture_slots).")
        given = inputs(plan, lengths, **outputs)
        out = self._step(max(lengths) + plan.steps + 1, given)
        return read_back(given["previous"], out[:7]), out[7:]

    def warm(self, spans: tuple[int, ...], example: dict[str, torch.Tensor]) -> int:
        """Capture a block per span (``spans``), largest first, with inputs that write nothing."""
        for span in reversed(spans):
            self._step(span, {**example, "active": torch.zeros_like(example["active"])})
        return len(self.steps)

    def _step(self, filled: int, inputs: dict[str, torch.Tensor]) -> tuple[torch.Tensor, ...]:
        """``draft_fn``'s outputs, its step captured per span on first use."""
        span = attended(filled, self.trash)
        if span not in self.steps:
            fn = draft_fn(self.reads(span), self.k, self.vocab, self.trash, self.tokens, self.gains)
            idle = {**inputs, "active": torch.zeros_like(inputs["active"])}  # capture writes nothing
            self.steps[span] = self.capture(fn, idle)
        return self.steps[span](**inputs)


def idle_inputs(layout) -> dict[str, torch.Tensor]:
    """A draft block's inputs that draft nothing (no slot proposes), shaped as the batch gives them (capture)."""
    head, slots = layout.pair.slm.get_output_embeddings().weight, layout.slots
    nothing = BlockPlan(0, (None,) * slots, (frozenset(),) * slots)
    return inputs(nothing, [0] * slots, logits=head.new_zeros(slots, head.shape[0]),
                  hidden=head.new_zeros(slots, head.shape[1]), scores=torch.zeros(slots, device=head.device),
                  thresholds=torch.zeros(slots, device=head.device),
                  previous=torch.full((slots,), -1, dtype=torch.long, device=head.device))


def inputs(plan: BlockPlan, lengths: list[int], **outputs: torch.Tensor) -> dict[str, torch.Tensor]:
    """``outputs`` (each slot's SLM outputs, threshold, last token) with ``plan`` as ``draft_fn`` reads it (staged
    copies, [S] each): each drafting row's standing (0 where a slot does not draft), whether it proposes, each slot's
    length (``lengths``) and end tokens (-2: none; ``ENDS`` at most); the policy's bounds."""
    standing = [s or _NOTHING for s in plan.standing]
    host = [[s.pending for s in standing], [int(s is not None) for s in plan.standing], [s.left for s in standing],
            list(lengths), [s.depth for s in standing], [int(s.everywhere) for s in standing],
            [int(s.ended) for s in standing]]
    ends = [sorted(e)[:ENDS] for e in plan.ends]
    host += list(map(list, zip(*[e + [-2] * (ENDS - len(e)) for e in ends])))
    device = outputs["previous"].device
    pending, active, remaining, length, depth, everywhere, ended, *ends_t = staged(host, device).unbind(0)
    below, confidence = staged([plan.below, plan.confidence], device, torch.float32).unbind(0)
    chance, expected, cost = staged([[s.chance for s in standing], [s.expected for s in standing],
                                     [s.cost for s in standing]], device, torch.float64).unbind(0)
    return {**outputs, "pending": pending, "active": active.bool(), "remaining": remaining, "lengths": length,
            "depth": depth, "everywhere": everywhere.bool(), "ended": ended.bool(), "ends": torch.stack(ends_t, 1),
            "below": below, "confidence": confidence, "chance": chance, "expected": expected, "cost": cost}


def read_back(previous: torch.Tensor, drafted: tuple[torch.Tensor, ...]) -> Drafted:
    """The block's one host synchronisation: the tokens committed before it (``previous`` [S]) and its proposals,
    routing, sure, committed, proposing and read flags and chances [k, S]; each proposing row's move
    (``Move.of``)."""
    flat = torch.cat([previous.to(drafted[0].device), *(part.flatten().long() for part in drafted)]).tolist()
    slots, steps = len(previous), drafted[0].shape[0]
    parts = [[flat[slots + (j * steps + i) * slots: slots + (j * steps + i + 1) * slots] for i in range(steps)]
             for j in range(len(drafted))]
    token, chance = parts[0], [[units / CHANCE_UNIT for units in step] for step in parts[6]]
    routed, sure, committed, active, read = ([[bool(v) for v in step] for step in part] for part in parts[1:6])
    moves = [{r: Move.of(c[r], h[r], s[r]) for r in range(slots) if a[r]}
             for c, h, s, a in zip(committed, routed, read, active)]
    return Drafted(flat[:slots], token, routed, sure, moves, chance)


_NOTHING = Standing(0, 0, 0, False, False)  # what the device reads for a slot that does not draft
