"""``generate``'s R2R loop: HF's records, streaming and stopping around the one decoding step.

The step itself (propose, route, catch up, commit, SLM step) is ``step.decode_step``, over a ``RunningBatch``
(``batch.py``) that the server's engine advances with the same step. Here the batch is the call's
left-padded rectangle on HF's own caches (eager, static, captured or compiled: ``capture.py``), in which every
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
from transformers import GenerationConfig, StoppingCriteriaList
from transformers.generation.streamers import BaseStreamer

from .batch import RunningBatch
from .choice import CallChoice
from .counters import Counters
from .layouts.rectangle import RectangleLayout
from .outputs import R2RGenerateOutput, RoutingAwareStreamer
from .policy import IMMEDIATE
from .routing import Routing, call_length
from .step import decode_step
from .layouts.rectangle import Committed


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
        routing: the call's router, threshold, processors, sampler and engine.
        input_ids: [B, P] left-padded prompts.
        stopping_criteria, generation_config: as prepared by HF ``generate``.
        attention_mask: [B, P], or None when nothing is padded.
        position_ids: [B, P] positions of the prompt tokens.
        streamer: an HF streamer (it already received the prompt); a ``RoutingAwareStreamer``
            is also told which rows the LLM wrote.
    """
    rows, prompt_len = input_ids.shape
    device = input_ids.device
    return_dict = bool(generation_config.return_dict_in_generate)
    keep_scores = return_dict and bool(generation_config.output_scores)
    keep_logits = return_dict and bool(generation_config.output_logits)
    pad = generation_config._pad_token_tensor
    pad_finished = pad is not None and any(hasattr(c, "eos_token_id") for c in stopping_criteria)
    max_len = call_length(generation_config, prompt_len)
    new_max = max_len - prompt_len

    routed_record = torch.zeros(rows, new_max, dtype=torch.bool, device=device)
    score_record = torch.full((rows, new_max), float("nan"), device=device)
    generated_record = torch.zeros(rows, new_max, dtype=torch.bool, device=device)
    scores_out: tuple[torch.Tensor, ...] | None = () if keep_scores else None
    logits_out: tuple[torch.Tensor, ...] | None = () if keep_logits else None

    counters = Counters()
    seq = Committed.from_prompt(input_ids, attention_mask, position_ids, routing.steps.capacity)
    layout = RectangleLayout(routing.steps, seq, counters)
    choice = CallChoice(routing.processors, routing.sampler, routing.vocab_size, seq.view)
    batch = RunningBatch.for_call(routing.pair, layout, choice, routing.threshold, routing.llm_budget, new_max,
                                  pad if pad_finished else None, counters)
    batch.keep_outputs = keep_scores or keep_logits
    step = 0
    while True:
        # The step's one host synchronisation also reads whether every row had finished at the previous step.
        running = batch.running.clone()
        before = routing.sampler.state()
        out = decode_step(batch, IMMEDIATE, ended=lambda synced: set(range(rows)) if synced.also[0] else set(),
                          also=(~running.any(),))
        if not out.committed:  # every row had finished at the previous step: this step's draw is not committed
            routing.sampler.restore(before)
            break
        routed_record[:, step] = out.routed
        score_record[:, step] = torch.where(running, out.router_scores, float("nan"))
        generated_record[:, step] = running
        if keep_scores:
            scores_out += (out.scores,)
        if keep_logits:
            logits_out += (out.raw_logits,)
        if streamer is not None:
            if isinstance(streamer, RoutingAwareStreamer):
                streamer.put_routing(out.routed.cpu(), score_record[:, step].cpu())
            streamer.put(out.token.cpu())
        batch.running = running & ~stopping_criteria(seq.view(), scores_out)
        step += 1
        if seq.length >= max_len:
            break

    if streamer is not None:
        streamer.end()
    sequences = seq.view().clone()
    if not return_dict:
        return sequences
    generated, routed_out = generated_record[:, :step], routed_record[:, :step]
    llm_tokens = (routed_out & generated).sum(-1)
    counters.generated, counters.llm_tokens = int(generated.sum()), int(llm_tokens.sum())
    return R2RGenerateOutput(
        sequences=sequences,
        scores=scores_out,
        logits=logits_out,
        routed=routed_out,
        router_scores=score_record[:, :step],
        generated_mask=generated,
        llm_token_rate=routed_out.sum().item() / max(generated.sum().item(), 1),
        threshold=routing.threshold,
        llm_budget=None if routing.llm_budget is None else float(routing.llm_budget),
        llm_tokens=llm_tokens,
        counters=counters.summary(),
    )
