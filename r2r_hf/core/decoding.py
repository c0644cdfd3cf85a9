"""The R2R decoding loop, read top to bottom.

Every step, for the whole batch:

1. ``propose``   the SLM's next token, through HF's logits processors and sampling;
2. ``route``     the router scores that proposal from the SLM's features;
3. ``catch up``  where any row routes, the LLM reads every token committed since its
                 last call in ONE forward and writes that row's token instead;
4. ``commit``    the chosen token is appended (pad for finished rows);
5. ``SLM step``  the SLM reads the committed token, whichever model wrote it;
6. ``record``    the token is recorded, streamed and checked against the stopping criteria.

Nothing is rolled back: the SLM's cache only ever holds committed tokens and the
LLM's cache only grows, so both can be static and the fixed-shape calls captured
(``capture.py``). Sampling keeps HF's random stream: it advances once per committed
token, because the LLM redraws from the state the SLM's draw started from. Hence
never-route equals ``slm.generate`` and always-route equals ``llm.generate``, token for
token, under the same seed. The host waits on the device once per step: for the
routing decision (which also tells whether every row finished at the previous step).
"""

from __future__ import annotations

import torch
from transformers import GenerationConfig, LogitsProcessorList, StoppingCriteriaList
from transformers.generation.streamers import BaseStreamer

from .outputs import R2RGenerateOutput, RoutingAwareStreamer
from .routing import Routing, call_length
from .steps import Committed, propose, rng_state, set_rng_state


def r2r_decode(
    routing: Routing,
    input_ids: torch.Tensor,
    logits_processor: LogitsProcessorList,
    stopping_criteria: StoppingCriteriaList,
    generation_config: GenerationConfig,
    attention_mask: torch.Tensor | None = None,
    position_ids: torch.Tensor | None = None,
    streamer: BaseStreamer | None = None,
) -> R2RGenerateOutput | torch.Tensor:
    """Generate with token-level routing, once HF ``generate`` has prepared everything.

    Args:
        routing: the call's models, router, threshold and engine.
        input_ids: [B, P] left-padded prompts.
        logits_processor, stopping_criteria, generation_config: as prepared by HF ``generate``.
        attention_mask: [B, P], or None when nothing is padded.
        position_ids: [B, P] positions of the prompt tokens.
        streamer: an HF streamer (it already received the prompt); a ``RoutingAwareStreamer``
            is also told which rows the LLM wrote.
    """
    batch, prompt_len = input_ids.shape
    device = input_ids.device
    do_sample = bool(generation_config.do_sample)
    return_dict = bool(generation_config.return_dict_in_generate)
    keep_scores = return_dict and bool(generation_config.output_scores)
    keep_logits = return_dict and bool(generation_config.output_logits)
    pad = generation_config._pad_token_tensor
    pad_finished = pad is not None and any(hasattr(c, "eos_token_id") for c in stopping_criteria)
    max_len = call_length(generation_config, prompt_len)
    vocab, steps = routing.vocab_size, routing.steps

    seq = Committed.from_prompt(input_ids, attention_mask, position_ids, steps.capacity)
    llm_seen = 0  # tokens of `seq` already in the LLM's cache (one lag shared by the batch)
    running = torch.ones(batch, dtype=torch.bool, device=device)
    routed_record = torch.zeros(batch, max_len - prompt_len, dtype=torch.bool, device=device)
    score_record = torch.full((batch, max_len - prompt_len), float("nan"), device=device)
    generated_record = torch.zeros(batch, max_len - prompt_len, dtype=torch.bool, device=device)
    scores_out: tuple[torch.Tensor, ...] | None = () if keep_scores else None
    logits_out: tuple[torch.Tensor, ...] | None = () if keep_logits else None

    routing.router.reset()
    slm_logits, slm_hidden = steps.slm_read(seq, 0)  # prefill the prompt
    step = 0
    while True:
        # 1. The SLM proposes (the RNG state is kept so the LLM can redraw in its place).
        rng = rng_state(device) if do_sample else None
        scores, token = propose(slm_logits, seq, logits_processor, vocab, do_sample)
        raw = slm_logits[:, :vocab] if keep_logits else None

        # 2. The router scores the proposal. The step's one host synchronisation reads the routing
        #    decision together with whether every row had finished at the previous step.
        routing.router.step()
        router_scores = steps.route_scores(slm_logits, slm_hidden, token).to(device)
        routed = (router_scores >= routing.threshold) & running
        any_routed, all_finished = torch.stack((routed.any(), ~running.any())).tolist()
        if all_finished:
            if do_sample:
                set_rng_state(device, rng)  # this step's draw is not committed
            break

        # 3. Routed rows: the LLM catches up in one chunk, then writes their token.
        if any_routed:
            llm_logits = steps.llm_read(seq, llm_seen)
            llm_seen = seq.length
            if do_sample:
                set_rng_state(device, rng)
            llm_scores, llm_token = propose(llm_logits, seq, logits_processor, vocab, do_sample)
            token = torch.where(routed, llm_token, token)
            if keep_scores:
                scores = torch.where(routed[:, None], llm_scores, scores)
            if keep_logits:
                raw = torch.where(routed[:, None], llm_logits[:, :vocab].to(raw.device), raw)

        # 4. Commit: finished rows get the pad token.
        if pad_finished:
            token = torch.where(running, token, pad)
        seq.append(token)

        # 5. The SLM reads the committed token, launched before the bookkeeping below so the device
        #    runs the step while the host keeps the records.
        if seq.length < max_len:
            slm_logits, slm_hidden = steps.slm_read(seq, seq.length - 1)

        # 6. Record, stream, check stopping.
        routed_record[:, step] = routed
        score_record[:, step] = torch.where(running, router_scores, float("nan"))
        generated_record[:, step] = running
        if keep_scores:
            scores_out += (scores,)
        if keep_logits:
            logits_out += (raw.float(),)
        if streamer is not None:
            if isinstance(streamer, RoutingAwareStreamer):
                streamer.put_routing(routed.cpu(), torch.where(running, router_scores, float("nan")).cpu())
            streamer.put(token.cpu())
        running = running & ~stopping_criteria(seq.view(), scores_out)
        step += 1
        if seq.length >= max_len:
            break

    if streamer is not None:
        streamer.end()
    sequences = seq.view().clone()
    if not return_dict:
        return sequences
    generated, routed_out = generated_record[:, :step], routed_record[:, :step]
    return R2RGenerateOutput(
        sequences=sequences,
        scores=scores_out,
        logits=logits_out,
        routed=routed_out,
        router_scores=score_record[:, :step],
        generated_mask=generated,
        llm_token_rate=routed_out.sum().item() / max(generated.sum().item(), 1),
        threshold=routing.threshold,
    )
