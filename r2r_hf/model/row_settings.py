"""One answer's settings, resolved exactly as ``generate`` resolves a call's: the server's rows use this.

``generate`` takes its options through HF's ``_prepare_generation_config`` (with R2R's own options put into
the call's copy: ``hf_generate.py``) and builds its processors with HF's ``_get_logits_processor``. A served
answer is one generate call: ``resolve_row`` runs the same two functions on the answer's options, so the
precedence is generate's (the answer's option > ``model.generation_config``, which holds the LLM's defaults
and a router's saved threshold and budget > the router's ``config.threshold``), every processor the LLM's
generation config asks for (a repetition penalty, a minimum length...) is applied as ``generate`` applies it,
and the core's checks (``check_threshold``, ``check_budget``, ``check_seed``) are the only range checks.
What a row cannot honour is refused by name, never dropped.

Everything here runs before a row reaches the decoding thread, so a bad option fails its own request only.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from transformers import GenerationConfig, LogitsProcessorList

from ..core.budget import check_budget
from ..core.choice import RowRule, batched_processors
from ..core.decoding import end_tokens
from ..core.routing import check_threshold
from ..core.sampling import check_seed, seeded_generator
from .generation import generation_options, refuse_unsupported

# Generation-config entries of HF generate that a served answer cannot apply as generate does.
ROW_UNSUPPORTED = {
    "stop_strings": "generate's stop strings end an answer after the string, an OpenAI server's before it: "
                    "send them as the request's stop",
    "max_time": "a time limit per call",
    "streamer": "a streamer",
}
# Below this temperature a draw is an argmax in all but name, and softmax(scores / T) overflows: greedy, as
# vLLM and the official R2R treat it.
GREEDY_BELOW = 1e-5


@dataclass(frozen=True)
class RowSettings:
    """What one answer decodes with (``resolve_row``).

    Args:
        generation_config: the answer's own resolved generation config.
        threshold, llm_budget, seed: R2R's options (budget None: none; seed None: a fresh stream).
        max_new_tokens: tokens the answer may write.
        eos_ids: ids that end it.
        processors: HF's processors of the answer, as ``generate`` builds them.
        speculate: pending positions the answer may hold at most (None: the server's; 0: it does not speculate).
    """

    generation_config: GenerationConfig
    threshold: float
    llm_budget: float | None
    seed: int | None
    max_new_tokens: int
    eos_ids: frozenset[int]
    processors: LogitsProcessorList
    speculate: int | None = None

    @property
    def do_sample(self) -> bool:
        return bool(self.generation_config.do_sample)

    def rule(self, device: torch.device, fresh_seed: int) -> RowRule:
        """The row's choice for the decoding thread: its processors and its random stream."""
        generator = None
        if self.do_sample:
            generator = seeded_generator(self.seed if self.seed is not None else fresh_seed, device)
        batched = batched_processors(self.processors)
        key = tuple((type(p).__name__, repr(sorted(vars(p).items()))) for p in self.processors) if batched else ()
        return RowRule(self.processors, generator, batched, key)


def sampling_options(temperature: float | None, top_p: float | None, top_k: int | None) -> dict[str, Any]:
    """generate's options for an OpenAI request's sampling fields (unset ones keep the model's defaults).

    ``temperature`` 0 (or below ``GREEDY_BELOW``) is greedy; any other sets ``do_sample``.
    """
    options: dict[str, Any] = {}
    if temperature is not None:
        options["do_sample"] = temperature >= GREEDY_BELOW
        if options["do_sample"]:
            options["temperature"] = temperature
    if top_p is not None:
        options["top_p"] = top_p
    if top_k is not None:
        options["top_k"] = top_k
    return options


def resolve_row(model, prompt: list[int], **options: Any) -> RowSettings:
    """One answer's settings from ``generate``'s keyword arguments (``max_new_tokens``, ``do_sample``,
    ``temperature``, ``top_p``, ``top_k``, ``threshold``, ``llm_budget``, ``seed``...).

    Raises ValueError in one sentence naming the option that is wrong.
    """
    if options.get("max_new_tokens") is None:
        raise ValueError("max_new_tokens must be given for a served answer.")
    generation_config, unused = model._prepare_generation_config(None, **options)  # generate's own resolution
    if unused:
        raise ValueError(f"Unknown generation options {sorted(unused)}; remove them.")
    refuse_unsupported(generation_options(generation_config, {}))
    for name, why in ROW_UNSUPPORTED.items():
        if getattr(generation_config, name, None) is not None:
            raise ValueError(f"The generation config sets {name}={getattr(generation_config, name)!r}, which a served "
                             f"answer cannot honour ({why}); unset it.")
    threshold = check_threshold(generation_config.threshold)
    budget = getattr(generation_config, "llm_budget", None)
    budget = None if budget is None else check_budget(budget)
    seed = getattr(generation_config, "seed", None)
    seed = None if seed is None else check_seed(seed)
    max_new = int(generation_config.max_new_tokens)
    device = model.device
    prompt_ids = torch.tensor([prompt], dtype=torch.long, device=device)
    # Private HF hooks, called as generate calls them (tests/test_hf_internals.py guards them): the lengths
    # (max_length and min_length from the new-token counts), the special tokens, then the processors.
    has_default = {name: options.get(name) is None and getattr(model.generation_config, name) is None
                   for name in ("max_length", "min_length")}  # as generate computes them
    generation_config = model._prepare_generated_length(
        generation_config=generation_config, has_default_max_length=has_default["max_length"],
        has_default_min_length=has_default["min_length"],
        model_input_name="input_ids", inputs_tensor=prompt_ids, input_ids_length=len(prompt))
    model._prepare_special_tokens(generation_config, True, device)
    processors = model._get_logits_processor(generation_config, input_ids_seq_length=len(prompt),
                                             encoder_input_ids=prompt_ids, device=device, model_kwargs={})
    return RowSettings(generation_config, threshold, budget, seed, max_new, end_tokens(generation_config), processors)
