"""``generate``'s R2R loop: HF's records, streaming and stopping around the one decoding step.

The step itself (propose, route, plan, catch up, commit, SLM read) is ``turn.decode_step``, over a
``RunningBatch`` (``batch.py``) that the server's engine advances with the same step. Here the batch is the call's
left-padded rectangle on HF's own caches (eager, static, captured or compiled: ``core/fast``), in which every
row commits a token at every step, and the LLM runs in the step a row routes (``policy.IMMEDIATE``): HF's
contracts — ``sequences``, streamers and stopping criteria all see one token per row per step — leave no room
for a row that waits, so waiting for a shared LLM forward is the server's (``r2r_hf/serve``).

Nothing is rolled back: the SLM's cache only ever holds committed tokens and the LLM's cache only grows, so
both can be static and the fixed-shape calls captured. Sampling keeps HF's random stream: it advances once
per committed token, because the LLM redraws from the state the SLM's draw started from (``choice.py``).
Hence never-route equals ``slm.generate`` and always-route equals ``llm.generate``, token for token, under
the same seed. The host waits on the device once per step: for the routing decision (which also tells
whether every row finished at the previous step).

Where a call gives an LLM budget, a token routes only where the row's budget allows too (``budget.py``:
never more than ceil(b * t) of t tokens, spent where the router is surest).
"""

from __future__ import annotations

import torch
from transformers import GenerationConfig, MaxLengthCriteria, StoppingCriteriaList
from transformers.generation.streamers import BaseStreamer

from .batch import RunningBatch
from .outputs import R2RGenerateOutput, RoutingAwareStreamer
from .routing import Routing, call_length
from .step import StepResult, Synced
from .turn import decode_step


class Finished:
    """A generate call's stop rule: the loop ends once every row has finished (HF's stopping criteria mark rows
    finished in ``batch.running``; whether any row still runs is read in the step's one synchronisation)."""

    def __init__(self, batch: RunningBatch) -> None:
        self.batch = batch

    def reads(self) -> tuple[torch.Tensor, ...]:
        return (self.batch.running.any(),)

    def ended(self, synced: Synced) -> dict[int, int]:
        return {r: len(synced.delivered[r]) for r in range(len(self.batch.rows))} if not synced.extra[0] else {}


def r2r_decode(
    routing: Routing,
    input_ids: torch.Tensor,
    stopping_criteria: StoppingCriteriaList,
    generation_config: GenerationConfig,
    attention_mask: torch.Tensor | None = None,
    position_ids: torch.Tensor | None = None,
    streamer: BaseStreamer | None = None,
) -> R2RGenerateOutput | torch.Tensor:
    """Generate with token-level routing, once HF ``generate`` has prepared everything.

    Args:
        routing: the call's router, threshold, processors, sampler and model calls.
        input_ids: [B, P] left-padded prompts.
        stopping_criteria, generation_config: as prepared by HF ``generate``.
        attention_mask: [B, P], or None when nothing is padded.
        position_ids: [B, P] positions of the prompt tokens.
        streamer: an HF streamer (it already received the prompt); a ``RoutingAwareStreamer``
            is also told which rows the LLM wrote.
    """
    rows, prompt_len = input_ids.shape
    return_dict = bool(generation_config.return_dict_in_generate)
    keep_scores = return_dict and bool(generation_config.output_scores)
    keep_logits = return_dict and bool(generation_config.output_logits)
    pad = generation_config._pad_token_tensor
    pad_finished = pad is not None and any(hasattr(c, "eos_token_id") for c in stopping_criteria)
    new_max = call_length(generation_config, prompt_len) - prompt_len
    batch = RunningBatch.for_call(routing, input_ids, new_max, attention_mask, position_ids,
                                  pad if pad_finished else None)
    records = _Records(keep_scores, keep_logits)
    criteria = _needed(stopping_criteria, prompt_len + new_max)
    seq, stops, streams = batch.layout.seq, Finished(batch), {}
    sampled = routing.policy.speculate > 0 and routing.sampler.do_sample  # streams to restore past a tail
    while True:
        before = routing.sampler.state()
        out = decode_step(batch, routing.policy, stops)
        if len(out.plan.ended) == rows:  # every row had finished at the previous step: this step's draw is not committed
            routing.sampler.restore(before)
            break
        if out.writers:
            column = records.write(out, batch, routing.vocab_size)
            if sampled:
                streams[column] = routing.sampler.state()
        _confirm(batch, records, criteria, streamer, prompt_len)
        if all(row.draining for row in batch.rows) and not batch.speculating():  # every row wrote its last token
            break
        if records.step < batch.rows[0].confirmed:  # every row ended inside a burst of confirmed columns
            break
    if streams and records.step:
        routing.sampler.restore(streams[records.step - 1])  # as after the last committed draw, not a discarded one
    if streamer is not None:
        streamer.end()
    sequences = seq.ids[:, : prompt_len + records.step].clone()
    if not return_dict:
        return sequences
    return records.output(sequences, routing, batch.counters)


def _confirm(batch: RunningBatch, records: _Records, criteria: StoppingCriteriaList, streamer: BaseStreamer | None,
             prompt_len: int) -> None:
    """The columns no rollback can change now are confirmed: recorded, streamed, and HF's stopping criteria mark
    the rows they end finished."""
    first, seq = records.step, batch.layout.seq
    for column in range(first, batch.rows[0].confirmed):
        if column > first and not batch.running.any():  # (a burst, after a resolution: it synced)
            break  # every row ended inside the burst: what follows is no answer's
        records.confirm(column, batch.running)
        if streamer is not None:
            if isinstance(streamer, RoutingAwareStreamer):
                streamer.put_routing(*(value.cpu() for value in records.column(column)))
            streamer.put(seq.ids[:, prompt_len + column].cpu())
        if criteria:
            end = prompt_len + column + 1
            _finish(batch, criteria(seq.ids[:, :end], records.scores_out), end)


def _needed(criteria: StoppingCriteriaList, length: int) -> StoppingCriteriaList:
    """HF's stopping criteria but a length limit at or past the call's own (``RowState.max_new`` ends every answer
    there): a criterion costs kernels at every step, and that one decides nothing. It stays where the call runs past
    the model's positions: it warns then, as HF's loop does."""
    return StoppingCriteriaList(c for c in criteria if not _idle(c, length))


def _idle(criterion, length: int) -> bool:
    """Whether ``criterion`` is a length limit a call of ``length`` tokens never meets before its own, silently."""
    if not isinstance(criterion, MaxLengthCriteria) or criterion.max_length < length:
        return False
    positions = getattr(criterion, "max_position_embeddings", None)
    return positions is None or length <= positions


def _finish(batch: RunningBatch, ended: torch.Tensor, end: int) -> None:
    """Rows whose answer HF's stopping criteria ended at column ``end`` - 1 are finished: what they wrote past it
    speculatively becomes the pad HF writes after an answer's end."""
    pad = batch.layout.pad
    if pad is not None and batch.layout.seq.length > end:  # (only where columns past ``end`` are speculative)
        ids = batch.layout.seq.ids[:, end : batch.layout.seq.length]
        ids.copy_(torch.where((batch.running & ended)[:, None], pad, ids))
    batch.running = batch.running & ~ended


class _Records:
    """What ``generate`` returns beside the sequences: one column per answer token, written when a step writes the
    column and confirmed once no rollback can change it (at once, without speculation). A column's records are its
    step's own tensors, kept by reference and stacked once at the end: no kernel per step (a rectangle's
    ``running`` is replaced, never written in place, so a reference keeps its value)."""

    def __init__(self, keep_scores: bool, keep_logits: bool) -> None:
        self.written: dict[int, tuple[torch.Tensor, ...]] = {}  # column -> routed, scores, running
        self.columns: list[tuple[torch.Tensor, ...]] = []  # confirmed, in order: those and ``running`` at confirming
        self.scores_out: tuple[torch.Tensor, ...] | None = () if keep_scores else None
        self.logits_out: tuple[torch.Tensor, ...] | None = () if keep_logits else None
        self.chosen: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # column -> what its tokens were chosen from
        self.step = 0  # columns confirmed

    def write(self, out: StepResult, batch: RunningBatch, vocab: int) -> int:
        """The column the step wrote (a rollback rewrites a column whose records stay); its index."""
        column = batch.rows[0].written - 1
        if out.settled is None or not out.settled.rollbacks:
            self.written[column] = (out.routed, out.router_scores, batch.running)
            if self.scores_out is not None or self.logits_out is not None:
                self.chosen[column] = chosen_from(out, vocab)
        return column

    def confirm(self, column: int, running: torch.Tensor) -> None:
        """Column ``column`` can no longer change; ``running``: its rows not finished before it. A row finished when
        the column was written routed nothing and scores NaN there; with speculation a row may have written the
        column before the host knew it had finished: ``running`` masks it too (without, it is the same mask)."""
        self.columns.append((*self.written.pop(column), running))
        if column in self.chosen:
            scores, logits = self.chosen.pop(column)
            if self.scores_out is not None:
                self.scores_out += (scores,)
            if self.logits_out is not None:
                self.logits_out += (logits,)
        self.step = column + 1

    def column(self, column: int) -> tuple[torch.Tensor, torch.Tensor]:
        """A confirmed column's routed flags and router scores [B] (a ``RoutingAwareStreamer``'s)."""
        routed, scores, written, running = self.columns[column]
        return routed & running, torch.where(written & running, scores, float("nan"))

    def matrices(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """[B, columns] routed flags, router scores and which entries are generated tokens."""
        routed, scores, written, running = (torch.stack(part, 1) for part in zip(*self.columns))
        return routed & running, torch.where(written & running, scores, float("nan")), running

    def output(self, sequences: torch.Tensor, routing: Routing, counters) -> R2RGenerateOutput:
        if self.columns:
            routed, scores, generated = self.matrices()
        else:
            routed = generated = torch.zeros(len(sequences), 0, dtype=torch.bool, device=sequences.device)
            scores = torch.zeros(len(sequences), 0, device=sequences.device)
        llm_tokens = (routed & generated).sum(-1)
        counters.generated, counters.llm_tokens = int(generated.sum()), int(llm_tokens.sum())
        return R2RGenerateOutput(
            sequences=sequences, scores=self.scores_out, logits=self.logits_out, routed=routed,
            router_scores=scores, generated_mask=generated,
            llm_token_rate=routed.sum().item() / max(generated.sum().item(), 1), threshold=routing.threshold,
            llm_budget=None if routing.llm_budget is None else float(routing.llm_budget), llm_tokens=llm_tokens,
            counters=counters.summary())


def chosen_from(out: StepResult, vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    """What each row's token was chosen from at one step (HF's output_scores and output_logits): the SLM's
    processed scores and logits, the LLM's where it wrote. Every row of a rectangle proposes: rows are slots."""
    scores, logits = out.proposal.scores, out.proposal.logits[:, :vocab].float()
    writers = list(out.plan.llm_writers)
    if not writers:
        return scores, logits
    where = torch.zeros(len(scores), dtype=torch.bool, device=scores.device)
    where[writers] = True
    scores = torch.where(where[:, None], _placed(out.llm_scores, writers, scores), scores)
    llm_logits = out.llm_logits[:, :vocab].to(logits.device).float()
    return scores, torch.where(where[:, None], _placed(llm_logits, list(out.plan.llm_reads), logits), logits)


def _placed(values: torch.Tensor, rows: list[int], like: torch.Tensor) -> torch.Tensor:
    """``values`` [k, ...] of ``rows`` placed in a tensor shaped like ``like`` (zeros elsewhere)."""
    out = torch.zeros_like(like)
    out[torch.tensor(rows, device=like.device)] = values.to(like.device, like.dtype)
    return out
