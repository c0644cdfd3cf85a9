"""``generate``'s R2R loop: HF's records, streaming and stopping around the one decoding step.

The step itself (propose, route, plan, catch up, commit, SLM read) is ``turn.decode_step``, over a
``RunningBatch`` (``batch.py``) that the server's engine advances with the same step. Here the batch is the call's
left-padded rectangle on HF's own caches (eager, static, captured or compiled: ``core/fast``), in which every
row commits a token at every step, and the LLM runs in the step a row routes (``policy.IMMEDIATE``): HF's
contracts — ``sequences``, streamers and stopping criteria all see one token per row per step — leave no room
for a row that waits, so waiting for a shared LLM forward is the server's (``r2r_hf/serve``).

Without speculation nothing is rolled back: the SLM's cache only ever holds committed tokens and the LLM's cache
only grows, so both can be static and the fixed-shape calls captured. With it (``routing.policy.speculate``) a
resolution may cut the whole rectangle back (``speculation.py``); HF's records, streamer and stopping criteria see
a column only once it is confirmed (``ledger.Applied.confirmed``). Sampling keeps HF's random stream: it advances
once per committed token, because the LLM redraws from the state the SLM's draw started from (``choice.py``), and
the call's stream ends where its last answer token's draw left it. Hence never-route equals ``slm.generate`` and
always-route equals ``llm.generate``, token for token, under the same seed. The host waits on the device once per
step: for the routing decision (which also tells whether every row finished at the previous step).

Where a call gives an LLM budget, a token routes only where the row's budget allows too (``budget.py``:
never more than ceil(b * t) of t tokens, spent where the router is surest).
"""

from __future__ import annotations

import torch
from transformers import GenerationConfig, MaxLengthCriteria, StoppingCriteriaList
from transformers.generation.streamers import BaseStreamer

from .batch import RunningBatch
from .ledger import Written
from .outputs import R2RGenerateOutput, RoutingAwareStreamer
from .routing import Routing, call_length
from .step import Synced
from .turn import StepResult, decode_step


class Finished:
    """A generate call's stop rule: the loop ends once every row has finished (HF's stopping criteria mark rows
    finished in ``batch.running``; whether any row still runs is read in the step's one synchronisation)."""

    def __init__(self, batch: RunningBatch) -> None:
        self.batch = batch

    def reads(self) -> tuple[torch.Tensor, ...]:
        return (self.batch.running.any(),)

    def ended(self, synced: Synced) -> dict[int, int]:
        return {r: len(synced.delivered[r]) for r in range(len(self.batch.ledger.rows))} if not synced.extra[0] else {}


def r2r_decode(routing: Routing, input_ids: torch.Tensor, stopping_criteria: StoppingCriteriaList,
               generation_config: GenerationConfig, attention_mask: torch.Tensor | None = None,
               position_ids: torch.Tensor | None = None,
               streamer: BaseStreamer | None = None) -> R2RGenerateOutput | torch.Tensor:
    """Generate with token-level routing, once HF ``generate`` has prepared everything: ``routing`` (the call's
    router, threshold, processors, sampler and model calls), the left-padded prompts ``input_ids`` [B, P] with their
    ``attention_mask`` (None: nothing padded) and ``position_ids``, HF's stopping criteria and config, and its
    streamer (it already received the prompt; a ``RoutingAwareStreamer`` is also told which rows the LLM wrote)."""
    rows, prompt_len = input_ids.shape
    new_max = call_length(generation_config, prompt_len) - prompt_len
    scored = bool(generation_config.return_dict_in_generate) or isinstance(streamer, RoutingAwareStreamer)
    batch = RunningBatch.for_call(routing, input_ids, new_max, attention_mask, position_ids,
                                  _finished_pad(generation_config, stopping_criteria), scored=scored,
                                  ends=end_tokens(generation_config))
    records = _Records.of(generation_config, routing.sampler.state())
    criteria, stops = _needed(stopping_criteria, prompt_len + new_max), Finished(batch)
    while True:
        out = decode_step(batch, routing.policy, stops)
        if len(out.plan.ended) == rows:  # every row had finished at the previous step: nothing is committed
            break
        records.write(out, batch.running, routing.vocab_size)
        if not _confirm(batch, records, out.applied.confirmed.get(0, []), criteria, streamer, prompt_len):
            break  # every row ended inside a burst of confirmed columns
        if batch.ledger.finished():  # every row wrote its last token
            break
    routing.sampler.restore(records.stream)  # where the last answer token's draw left it, not a discarded draw's
    if streamer is not None:
        streamer.end()
    sequences = batch.layout.seq.ids[:, : prompt_len + records.step].clone()
    return records.output(sequences, routing, batch.counters, batch.ledger.rows) if records.return_dict else sequences


def end_tokens(config: GenerationConfig) -> frozenset[int]:
    """The tokens that end an answer (HF's EOS ids: one, a list, or none); ``generate``'s and a served row's."""
    eos = config.eos_token_id
    return frozenset([] if eos is None else [eos] if isinstance(eos, int) else eos)


def _finished_pad(config: GenerationConfig, criteria: StoppingCriteriaList) -> torch.Tensor | None:
    """The pad HF writes after a row's end, where an EOS criterion can end rows before the others (else None)."""
    pad = config._pad_token_tensor
    return pad if pad is not None and any(hasattr(c, "eos_token_id") for c in criteria) else None


def _confirm(batch: RunningBatch, records: _Records, confirmed: list[Written], criteria: StoppingCriteriaList,
             streamer: BaseStreamer | None, prompt_len: int) -> bool:
    """The columns the step confirmed (no rollback can change them now) are recorded, streamed, and HF's stopping
    criteria mark the rows they end finished; False where every row ended before the last of them."""
    seq = batch.layout.seq
    for n, written in enumerate(confirmed):
        if n and not batch.running.any():  # (a burst, after a resolution: it synced)
            return False  # every row ended inside the burst: what follows is no answer's
        column = written.index
        records.confirm(written, batch.running)
        if streamer is not None:
            if isinstance(streamer, RoutingAwareStreamer):
                streamer.put_routing(*(value.cpu() for value in records.column(column)))
            streamer.put(seq.ids[:, prompt_len + column].cpu())
        if criteria:
            end = prompt_len + column + 1
            _finish(batch, criteria(seq.ids[:, :end], records.scores_out), end)
    return True


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

    def __init__(self, return_dict: bool, keep_scores: bool, keep_logits: bool, stream=None) -> None:
        self.return_dict = return_dict
        self.written: dict[int, tuple[torch.Tensor, ...]] = {}  # column -> routed, scores, running
        self.columns: list[tuple[torch.Tensor, ...]] = []  # confirmed, in order: those and ``running`` at confirming
        self.scores_out: tuple[torch.Tensor, ...] | None = () if keep_scores else None
        self.logits_out: tuple[torch.Tensor, ...] | None = () if keep_logits else None
        self.chosen: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # column -> what its tokens were chosen from
        self.step = 0  # columns confirmed
        self.stream = stream  # the call's random stream after the last confirmed column (None: greedy)

    @classmethod
    def of(cls, config: GenerationConfig, stream) -> _Records:
        """What HF's ``config`` asks to return; ``stream``: where the call's random stream starts."""
        kept = bool(config.return_dict_in_generate)
        return cls(kept, kept and bool(config.output_scores), kept and bool(config.output_logits), stream)

    def write(self, out: StepResult, running: torch.Tensor, vocab: int) -> None:
        """The column the step wrote, if any (a rollback rewrites a column whose records stay); ``running``: the
        rows not finished when it was written."""
        if out.applied.written and not out.outcome.rollbacks:
            column = next(iter(out.applied.written.values()))  # (lockstep: every writer wrote the same column)
            routed = out.routed
            if out.plan.llm_writers and not out.proposal.rows:  # frontier tokens (``StepPlan.frontier``): the LLM's
                routed = routed.index_fill(0, torch.tensor(out.plan.llm_writers, device=routed.device), True)
            self.written[column] = (routed, out.router_scores, running)
            if self.scores_out is not None or self.logits_out is not None:
                self.chosen[column] = chosen_from(out, vocab)

    def confirm(self, written: Written, running: torch.Tensor) -> None:
        """Column ``written.index`` can no longer change; ``running``: its rows not finished before it. A row
        finished when the column was written routed nothing and scores NaN there; with speculation a row may have
        written the column before the host knew it had finished: ``running`` masks it too (without, it is the same
        mask)."""
        column = written.index
        if written.stream is not None:
            self.stream = written.stream
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

    def output(self, sequences: torch.Tensor, routing: Routing, counters, rows) -> R2RGenerateOutput:
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
            counters=counters.summary(), speculation=_per_row(rows, sequences.device))


def _per_row(rows, device: torch.device) -> dict[str, torch.Tensor]:
    """Each row's speculative counts (``ledger.Speculated``) as long [B] tensors by name."""
    counts = [row.speculated.as_dict() for row in rows]
    return {name: torch.tensor([c[name] for c in counts], device=device) for name in counts[0]}


def chosen_from(out: StepResult, vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    """What each row's token was chosen from at one step (HF's output_scores and output_logits): the SLM's
    processed scores and logits, the LLM's where it wrote. Every row of a rectangle proposes: rows are slots."""
    scores, logits = out.proposal.scores, out.proposal.logits[:, :vocab].float()
    writers = list(out.plan.llm_writers)
    if not writers:
        return scores, logits
    where = torch.zeros(len(scores), dtype=torch.bool, device=scores.device)
    where[writers] = True
    scores = torch.where(where[:, None], _placed(out.read.scores, writers, scores), scores)
    llm_logits = out.read.logits[:, :vocab].to(logits.device).float()
    return scores, torch.where(where[:, None], _placed(llm_logits, list(out.plan.llm_reads), logits), logits)


def _placed(values: torch.Tensor, rows: list[int], like: torch.Tensor) -> torch.Tensor:
    """``values`` [k, ...] of ``rows`` placed in a tensor shaped like ``like`` (zeros elsewhere)."""
    out = torch.zeros_like(like)
    out[torch.tensor(rows, device=like.device)] = values.to(like.device, like.dtype)
    return out
