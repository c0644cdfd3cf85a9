"""The R2R decoding loop, read top to bottom.

Every step, for the whole batch:

1. ``propose``   the SLM's next token, through HF's logits processors and sampling;
2. ``route``     the router scores that proposal from the SLM's features;
3. ``catch_up``  where any row routes, the LLM reads every token committed since its
                 last call in ONE forward and writes that row's token instead;
4. ``commit``    the chosen token is appended (pad for finished rows), streamed and
                 checked against the stopping criteria;
5. ``slm_step``  the SLM reads the committed token, whichever model wrote it.

Nothing is rolled back: the SLM's cache only ever holds committed tokens and the
LLM's cache only grows, so both can be static. Sampling keeps HF's random stream:
it advances once per committed token, because the LLM redraws from the state the
SLM's draw started from. Hence never-route equals ``slm.generate`` and always-route
equals ``llm.generate``, token for token, under the same seed.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from transformers import GenerationConfig, LogitsProcessorList, StoppingCriteriaList
from transformers.cache_utils import Cache, DynamicCache, StaticCache

from .features import HiddenStateCapture, embed_tokens, input_device, lm_forward, output_device, topk_logits
from .outputs import R2RGenerateOutput
from .router import Router


@dataclass
class Committed:
    """The committed sequence, in buffers allocated once for the whole call."""

    ids: torch.Tensor  # [B, max_len]
    mask: torch.Tensor | None  # [B, max_len], None when no row is padded
    positions: torch.Tensor  # [B, max_len]
    length: int

    @classmethod
    def from_prompt(
        cls, input_ids: torch.Tensor, mask: torch.Tensor | None, positions: torch.Tensor | None, max_len: int
    ) -> Committed:
        batch, prompt = input_ids.shape
        ids = input_ids.new_zeros(batch, max_len)
        ids[:, :prompt] = input_ids
        pos = input_ids.new_zeros(batch, max_len)
        if positions is None:
            positions = torch.arange(prompt, device=input_ids.device).expand(batch, prompt)
        # Generated positions continue from each row's last prompt position.
        steps = torch.arange(1, max_len - prompt + 1, device=input_ids.device)
        pos[:, :prompt] = positions
        pos[:, prompt:] = positions[:, -1:] + steps
        full_mask = None
        if mask is not None:
            full_mask = mask.new_ones(batch, max_len)
            full_mask[:, :prompt] = mask
        return cls(ids, full_mask, pos, prompt)

    def view(self) -> torch.Tensor:
        return self.ids[:, : self.length]

    def mask_upto(self, end: int) -> torch.Tensor | None:
        return None if self.mask is None else self.mask[:, :end]

    def append(self, token: torch.Tensor) -> None:
        self.ids[:, self.length] = token
        self.length += 1


def make_cache(model: torch.nn.Module, implementation: str | None, max_len: int) -> Cache:
    """A fresh KV cache for one model; R2R never crops, so a static cache is always allowed."""
    if implementation == "static":
        return StaticCache(config=model.config, max_cache_len=max_len)
    return DynamicCache(config=model.config)


def rng_state(device: torch.device) -> torch.Tensor:
    """State of the generator ``torch.multinomial`` draws from on ``device``."""
    if device.type == "cpu":
        return torch.get_rng_state()
    return torch.get_device_module(device.type).get_rng_state(device.index)


def set_rng_state(device: torch.device, state: torch.Tensor) -> None:
    if device.type == "cpu":
        torch.set_rng_state(state)
    else:
        torch.get_device_module(device.type).set_rng_state(state, device.index)


def pick(scores: torch.Tensor, do_sample: bool, width: int) -> torch.Tensor:
    """HF's token choice: a multinomial draw from softmax(scores), or the argmax.

    A draw is taken over the writing model's own lm_head width (padding rows at -inf):
    the random stream advances by what that model's own ``generate`` would consume.
    """
    if not do_sample:
        return scores.argmax(-1)
    if width > scores.shape[-1]:
        scores = torch.nn.functional.pad(scores, (0, width - scores.shape[-1]), value=-float("inf"))
    return torch.multinomial(scores.softmax(-1), num_samples=1).squeeze(1)


def propose(
    logits: torch.Tensor, seq: Committed, processors: LogitsProcessorList, vocab: int, do_sample: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """Steps 1 and 3: a model's processed scores over the shared vocabulary, and its token."""
    scores = processors(seq.view(), logits[:, :vocab].to(device=seq.ids.device, dtype=torch.float32, copy=True))
    return scores, pick(scores, do_sample, width=logits.shape[-1])


def route(
    scorer: Callable,
    router_device: torch.device,
    slm: torch.nn.Module,
    logits: torch.Tensor,
    hidden: torch.Tensor,
    token: torch.Tensor,
    num_topk: int,
    threshold: float,
    running: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Step 2: router scores [B] for the proposed tokens, and which running rows go to the LLM.

    ``scorer`` is ``router.scores`` or a compiled version of it; ``router_device`` is where it runs.
    """
    d = router_device
    scores = scorer(topk_logits(logits, num_topk).to(d), embed_tokens(slm, token).to(d), hidden.to(d))
    scores = scores.to(running.device)
    return scores, (scores >= threshold) & running


def catch_up(llm: torch.nn.Module, seq: Committed, seen: int, cache: Cache) -> torch.Tensor:
    """Step 3: the LLM reads ``seq[seen:]`` in one forward over its cache; returns its next-token logits."""
    end = seq.length
    logits = lm_forward(llm, seq.ids[:, seen:end], seq.mask_upto(end), seq.positions[:, seen:end], cache)
    return logits[:, -1]


def slm_step(
    slm: torch.nn.Module, seq: Committed, cache: Cache, start: int, compiled: Callable | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Step 5: the SLM reads ``seq[start:]``; returns its next-token logits and post-norm hidden state.

    ``compiled`` (a compiled ``slm.__call__``, static cache only) runs one-token steps with fixed
    shapes: the whole mask buffer, and the last hidden state from ``output_hidden_states``.
    """
    end = seq.length
    if compiled is not None and end - start == 1:
        device = input_device(slm)
        out = compiled(
            input_ids=seq.ids[:, start:end].to(device).clone(memory_format=torch.contiguous_format),
            attention_mask=None if seq.mask is None else seq.mask.to(device),
            position_ids=seq.positions[:, start:end].to(device).clone(memory_format=torch.contiguous_format),
            past_key_values=cache, use_cache=True, logits_to_keep=1, output_hidden_states=True, return_dict=True,
        )
        return out.logits[:, -1], out.hidden_states[-1][:, -1]
    with HiddenStateCapture(slm) as capture:
        logits = lm_forward(slm, seq.ids[:, start:end], seq.mask_upto(end), seq.positions[:, start:end], cache)
        return logits[:, -1], capture.hidden[:, -1]


def r2r_decode(
    slm: torch.nn.Module,
    llm: torch.nn.Module,
    router: Router,
    input_ids: torch.Tensor,
    logits_processor: LogitsProcessorList,
    stopping_criteria: StoppingCriteriaList,
    generation_config: GenerationConfig,
    threshold: float,
    vocab_size: int,
    num_topk_logits: int,
    attention_mask: torch.Tensor | None = None,
    position_ids: torch.Tensor | None = None,
    streamer=None,
    compiled_slm: Callable | None = None,
    router_scores_fn: Callable | None = None,
) -> R2RGenerateOutput | torch.Tensor:
    """Generate with token-level routing; called by ``R2RForCausalLM.generate`` once HF has prepared everything.

    Args:
        slm, llm, router: the two models and the router (router in eval mode).
        input_ids: [B, P] left-padded prompts.
        logits_processor, stopping_criteria, generation_config: as prepared by HF ``generate``.
        threshold: route where ``score >= threshold``.
        vocab_size: the vocabulary both models share (logits are cut to it).
        num_topk_logits: how many sorted SLM logits the router reads.
        attention_mask: [B, P], or None when nothing is padded.
        position_ids: [B, P] positions of the prompt tokens.
        streamer: an HF streamer; it already received the prompt.
        compiled_slm: a compiled ``slm.__call__`` for the one-token steps (needs a static cache).
        router_scores_fn: a compiled ``router.scores``.
    """
    batch, prompt_len = input_ids.shape
    device = input_ids.device
    do_sample = bool(generation_config.do_sample)
    return_dict = bool(generation_config.return_dict_in_generate)
    keep_scores = return_dict and bool(generation_config.output_scores)
    keep_logits = return_dict and bool(generation_config.output_logits)
    pad = generation_config._pad_token_tensor
    pad_finished = pad is not None and any(hasattr(c, "eos_token_id") for c in stopping_criteria)
    max_len = max(int(generation_config.max_length), prompt_len + 1)
    max_new = max_len - prompt_len

    seq = Committed.from_prompt(input_ids, attention_mask, position_ids, max_len)
    cache_kind = generation_config.cache_implementation
    slm_cache, llm_cache = make_cache(slm, cache_kind, max_len), make_cache(llm, cache_kind, max_len)
    llm_seen = 0  # tokens of `seq` already in the LLM's cache (one lag shared by the batch)

    running = torch.ones(batch, dtype=torch.bool, device=device)
    routed_record = torch.zeros(batch, max_new, dtype=torch.bool, device=device)
    score_record = torch.full((batch, max_new), float("nan"), device=device)
    generated_record = torch.zeros(batch, max_new, dtype=torch.bool, device=device)
    scores_out: tuple[torch.Tensor, ...] | None = () if keep_scores else None
    logits_out: tuple[torch.Tensor, ...] | None = () if keep_logits else None

    router.reset()
    scorer = router_scores_fn or router.scores
    param = next(iter(router.parameters()), None)
    router_device = param.device if param is not None else output_device(slm)
    slm_logits, slm_hidden = slm_step(slm, seq, slm_cache, start=0)  # prefill the prompt
    step = 0
    while True:
        # 1. The SLM proposes (the RNG state is kept so the LLM can redraw in its place).
        rng = rng_state(device) if do_sample else None
        scores, token = propose(slm_logits, seq, logits_processor, vocab_size, do_sample)
        raw = slm_logits[:, :vocab_size] if keep_logits else None

        # 2. The router scores the proposal.
        router_scores, routed = route(
            scorer, router_device, slm, slm_logits, slm_hidden, token, num_topk_logits, threshold, running
        )

        # 3. Routed rows: the LLM catches up in one chunk, then writes their token.
        if routed.any():
            llm_logits = catch_up(llm, seq, llm_seen, llm_cache)
            llm_seen = seq.length
            if do_sample:
                set_rng_state(device, rng)
            llm_scores, llm_token = propose(llm_logits, seq, logits_processor, vocab_size, do_sample)
            token = torch.where(routed, llm_token, token)
            if keep_scores:
                scores = torch.where(routed[:, None], llm_scores, scores)
            if keep_logits:
                raw = torch.where(routed[:, None], llm_logits[:, :vocab_size].to(raw.device), raw)

        # 4. Commit: finished rows get the pad token; stream; check stopping.
        if pad_finished:
            token = torch.where(running, token, pad)
        seq.append(token)
        routed_record[:, step] = routed
        score_record[:, step] = torch.where(running, router_scores, float("nan"))
        generated_record[:, step] = running
        if keep_scores:
            scores_out += (scores,)
        if keep_logits:
            logits_out += (raw.float(),)
        if streamer is not None:
            if hasattr(streamer, "put_routing"):  # r2r_hf streamers also learn who wrote each token
                streamer.put_routing(routed.cpu(), router_scores.cpu())
            streamer.put(token.cpu())
        running = running & ~stopping_criteria(seq.view(), scores_out)
        step += 1
        if not running.any() or seq.length >= max_len:
            break

        # 5. The SLM reads the committed token.
        slm_logits, slm_hidden = slm_step(slm, seq, slm_cache, start=seq.length - 1, compiled=compiled_slm)

    if streamer is not None:
        streamer.end()
    sequences = seq.view().clone()
    if not return_dict:
        return sequences
    generated = generated_record[:, :step]
    routed_out = routed_record[:, :step]
    return R2RGenerateOutput(
        sequences=sequences,
        scores=scores_out,
        logits=logits_out,
        routed=routed_out,
        router_scores=score_record[:, :step],
        generated_mask=generated,
        llm_token_rate=routed_out.sum().item() / max(generated.sum().item(), 1),
        threshold=threshold,
    )
