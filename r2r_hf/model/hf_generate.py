"""``R2RGenerationMixin``: HF ``generate`` with the R2R loop in ``_sample``, through HF's private hooks.

``generate`` is HF's own: it prepares the processors, stopping criteria, streamer, inputs and a per-call copy
of the generation config (which carries the call's ``threshold``), then calls ``_sample``, replaced here with
the R2R loop (``core.decoding``). Every hook used is guarded by ``tests/test_hf_internals.py``.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers import GenerationConfig, GenerationMixin
from transformers.generation.stopping_criteria import MaxLengthCriteria, StoppingCriteriaList

from ..core.costs import resolved_draft_cost
from ..core.decoding import r2r_decode
from ..core.routing import Routing
from .generation import generation_options, pop_call_options, refuse_unsupported, set_call_options
from .loading import context_length


class R2RGenerationMixin(GenerationMixin):
    """The generation half of ``R2RForCausalLM`` (it provides ``slm``, ``llm``, ``routed_pair`` and ``config``)."""

    def generate(
        self,
        inputs: torch.Tensor | None = None,
        generation_config: GenerationConfig | None = None,
        *args: Any,
        threshold: float | None = None,
        **kwargs: Any,
    ):
        """HF ``generate`` with R2R routing; every HF generate argument keeps its meaning.

        Args:
            inputs: prompt ids [B, P] (left-padded for batches), or pass ``input_ids=``.
            generation_config: as in HF; a ``threshold`` set on it is honoured.
            threshold: route to the LLM where the router's score >= threshold, for this call only
                (default: ``config.threshold``). ``0.0`` routes every token, ``float("inf")`` none.
            kwargs: ``seed=N`` draws this call's samples from its own generator (the draws
                ``torch.manual_seed(N)`` would give, without touching the global stream: safe beside
                concurrent calls); and anything HF ``generate`` accepts (max_new_tokens, do_sample, streamer,
                stop_strings with tokenizer, logits_processor, return_dict_in_generate,
                cache_implementation="static", compile_config...).

        Returns:
            The sequences, or with ``return_dict_in_generate=True`` an ``R2RGenerateOutput``
            that adds ``routed``, ``router_scores``, ``generated_mask`` and ``llm_token_rate``.
        """
        self.slm, self.llm  # noqa: B018 - raises a clear error when no models are attached
        prompt = inputs if inputs is not None else kwargs.get("input_ids")
        if isinstance(prompt, torch.Tensor) and (prompt.is_floating_point() or prompt.dim() != 2):
            raise ValueError(
                f"generate takes token ids, a [batch, length] integer tensor (inputs or input_ids=), but got a "
                f"{str(prompt.dtype).replace('torch.', '')} tensor of shape {list(prompt.shape)}; prompts as "
                "embeddings are not supported (the SLM and the LLM each embed the ids with their own table)."
            )
        if isinstance(prompt, torch.Tensor) and prompt.shape[-1] == 0:
            raise ValueError("The prompt is empty (input_ids has 0 tokens); pass at least one token, e.g. the "
                             "tokenizer's BOS token.")
        # HF diverts some modes (contrastive, DoLa, custom_generate) before its own validation.
        refuse_unsupported({**(generation_config.to_dict() if generation_config else {}), **kwargs})
        if threshold is not None:
            kwargs["threshold"] = threshold
        return super().generate(inputs, generation_config, *args, **kwargs)

    def _prepare_generation_config(self, generation_config: GenerationConfig | None, **kwargs: Any):
        # Private HF hook (tests/test_hf_internals.py guards it): the call's copy of the generation
        # config is made here, so the call's threshold goes into that copy.
        options = pop_call_options(kwargs)
        generation_config, model_kwargs = super()._prepare_generation_config(generation_config, **kwargs)
        set_call_options(generation_config, options, self.config.threshold)
        return generation_config, model_kwargs

    def _validate_generation_mode(self, generation_mode, generation_config, generation_mode_kwargs) -> None:
        # Private HF hook: here the call's final generation config is known, including options
        # inherited from model.generation_config.
        refuse_unsupported(generation_options(generation_config, generation_mode_kwargs))
        super()._validate_generation_mode(generation_mode, generation_config, generation_mode_kwargs)

    def _get_stopping_criteria(self, *args: Any, **kwargs: Any) -> StoppingCriteriaList:
        # Private HF hook: HF's length criterion warns once a call runs past config.max_position_embeddings,
        # which a router's config lacks; the pair's context is the limit, so model.generate warns as slm.generate.
        criteria = super()._get_stopping_criteria(*args, **kwargs)
        for criterion in criteria:
            if isinstance(criterion, MaxLengthCriteria) and criterion.max_position_embeddings is None:
                criterion.max_position_embeddings = context_length(self.slm, self.llm)
        return criteria

    def _prepare_cache_for_generation(self, *args: Any, **kwargs: Any) -> None:
        # Private HF hook: the R2R loop builds one cache per model itself.
        return None

    def _sample(
        self,
        input_ids: torch.LongTensor,
        logits_processor,
        stopping_criteria,
        generation_config,
        synced_gpus: bool = False,
        streamer=None,
        **model_kwargs: Any,
    ):
        # Private HF hook: generate() dispatches greedy and sampling here.
        if synced_gpus:
            raise ValueError("R2RForCausalLM.generate does not support synced_gpus (DeepSpeed ZeRO-3 / FSDP).")
        pair = self.routed_pair()
        if getattr(generation_config, "speculate", None):  # (draft_cost "auto": timed once per model)
            generation_config.draft_cost = resolved_draft_cost(getattr(generation_config, "draft_cost", None), pair)
        routing = Routing.for_call(pair, generation_config, logits_processor, input_ids, self.capture_store)
        try:
            return r2r_decode(routing, input_ids, stopping_criteria, generation_config,
                              attention_mask=model_kwargs.get("attention_mask"),
                              position_ids=model_kwargs.get("position_ids"), streamer=streamer)
        finally:
            routing.calls.close()  # captured steps go back to the model's store
