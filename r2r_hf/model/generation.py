"""What ``R2RForCausalLM.generate`` accepts: HF's options minus those R2R cannot honour, plus R2R's own.

R2R's own options (``R2R_OPTIONS``) are entries of the call's generation config like any other
option: HF copies the generation config for every call, so the values a call routes with live in
that copy and nowhere else. Precedence, highest first: ``generate(threshold=...)``, a value set on
the ``GenerationConfig`` passed to ``generate``, one set on ``model.generation_config``, and (for
``threshold``) the router's ``config.threshold``. Set on ``model.generation_config``, they are saved in
the router's ``generation_config.json`` and survive loading; every other entry is the LLM's.
"""

from __future__ import annotations

import copy
import os
from typing import Any

from transformers import GenerationConfig

from .hub import read_router_json

# Options of HF generate that R2R cannot honour, with the reason given to the user.
UNSUPPORTED = {
    "num_beams": "beam search",
    "num_beam_groups": "group beam search",
    "penalty_alpha": "contrastive search",
    "dola_layers": "DoLa decoding",
    "prompt_lookup_num_tokens": "prompt lookup decoding",
    "guidance_scale": "classifier-free guidance",
    "output_attentions": "returning attentions (two models write the tokens)",
    "output_hidden_states": "returning hidden states (two models write the tokens)",
    "assistant_model": "assisted generation",
    "custom_generate": "a custom decoding loop would replace R2R's",
    "past_key_values": "R2R keeps one cache per model",
    "cache": "R2R keeps one cache per model",  # the name transformers 5.24 gave past_key_values
    "inputs_embeds": "prompts as embeddings (the SLM and the LLM each embed the ids with their own table; pass input_ids)",
    # HF builds its processor from config.vocab_size, which a router's config lacks (two models, one shared vocabulary).
    "watermarking_config": "watermarking",
}
_NEUTRAL_VALUES = {"num_beams": 1, "num_beam_groups": 1, "guidance_scale": 1.0}
CACHES = (None, "dynamic", "static")


def refuse_unsupported(options: dict[str, Any]) -> None:
    """Raise one ValueError naming every generate option R2R cannot honour."""
    problems = []
    for name, what in UNSUPPORTED.items():
        value = options.get(name)
        plain = isinstance(value, (int, float, str))  # bool is an int
        if value is None or (plain and (value == 0 or value == _NEUTRAL_VALUES.get(name))):
            continue
        problems.append(f"{name}={value!r} ({what})" if plain else f"{name}={type(value).__name__} ({what})")
    if options.get("cache_implementation") not in CACHES:
        problems.append(f"cache_implementation={options['cache_implementation']!r} (use 'dynamic' or 'static')")
    if problems:
        raise ValueError(
            f"R2RForCausalLM.generate cannot honour {', '.join(problems)}: R2R writes one token per step, "
            "greedy or sampled, with one cache per model. Remove the option."
        )


def generation_options(generation_config: GenerationConfig, mode_kwargs: dict[str, Any]) -> dict[str, Any]:
    """The options ``refuse_unsupported`` checks, read from a call's final generation config."""
    options = {name: getattr(generation_config, name, None) for name in UNSUPPORTED}
    options["cache_implementation"] = generation_config.cache_implementation
    options["assistant_model"] = mode_kwargs.get("assistant_model")
    return options


# R2R's own generate options, with what each means; HF's GenerationConfig keeps unknown entries as attributes.
# A router saves them in its generation_config.json, and they are kept when the LLM's generation config (EOS,
# pad, sampling defaults) replaces the rest.
R2R_OPTIONS = {
    "threshold": "route where the router's score >= threshold (default: the router's config.threshold)",
    "seed": "draw this call's samples from its own generator seeded so (as torch.manual_seed(seed) would), "
            "leaving the global random stream untouched",
    "llm_budget": "the LLM writes at most ceil(llm_budget * t) of any answer's first t tokens, where the router is "
                  "surest (r2r_hf/core/budget.py); with a threshold, a token routes only where both allow",
    "speculate": "a routed row goes on with the SLM's token, up to this many routed positions pending, and one LLM "
                 "forward later confirms them or corrects the first it rejects (r2r_hf/core/speculation.py); the "
                 "answers do not change (0: off)",
    "llm_max_wait": "with speculate: the LLM resolves pending positions once the oldest is this many steps old "
                    "(default 32)",
    "speculate_below": "with speculate: a routed row goes on only where the router's score is below this (where it "
                       "is surer the LLM disagrees far more often; the row waits for it instead)",
    "draft_confidence": "with speculate: a routed row goes on only where the SLM's probability of its token is at "
                        "least this (as HF assisted generation's assistant_confidence_threshold; 0: everywhere); at "
                        "threshold 0 a draft ends with that token",
    "fixed_depth": "with speculate: rows at threshold 0 draft up to speculate positions every time (default False: "
                   "each row's depth follows its own acceptance, r2r_hf/core/plan.py adapted)",
    "draft_cost": "with speculate: rows at threshold 0 end each draft where one more token no longer pays for itself "
                  "(the expected-gain rule, r2r_hf/core/moves.py draft_ends), an LLM forward costing this many SLM "
                  "steps (measured: 2.5 for Qwen2.5-Coder 0.5B + 1.5B on a CPU, 5.6 for R1-Distill 1.5B + 32B on "
                  "an H200), or 'auto': timed on the pair's device at the first such call (r2r_hf/core/costs.py); "
                  "their depth is then at most speculate (default: off)",
}
ROUTER_ENTRIES = tuple(R2R_OPTIONS)


def pop_call_options(kwargs: dict[str, Any]) -> dict[str, Any]:
    """Take R2R's own options out of ``generate``'s keyword arguments (HF would refuse them as unused)."""
    return {name: kwargs.pop(name) for name in R2R_OPTIONS if kwargs.get(name) is not None}


def set_call_options(generation_config: GenerationConfig, options: dict[str, Any], default_threshold: float) -> None:
    """Put the call's R2R options into its generation config (see the module docstring for precedence)."""
    for name, value in options.items():
        setattr(generation_config, name, value)
    if getattr(generation_config, "threshold", None) is None:
        generation_config.threshold = default_threshold


def saved_router_entries(location: str | os.PathLike, hub: dict[str, Any] | None = None) -> dict[str, Any]:
    """The ``ROUTER_ENTRIES`` a router's ``generation_config.json`` holds (read as written: HF drops unknown
    entries of a generation config marked ``_from_model_config``)."""
    saved = read_router_json(location, "generation_config.json", hub)
    return {k: saved[k] for k in ROUTER_ENTRIES if isinstance(saved, dict) and saved.get(k) is not None}


def pair_generation_config(llm_config: GenerationConfig, router_config: GenerationConfig | None) -> GenerationConfig:
    """The LLM's generation config (so always-routing behaves as ``llm.generate``) plus the router's own entries."""
    merged = copy.deepcopy(llm_config)
    for name in ROUTER_ENTRIES:
        value = getattr(router_config, name, None)
        if value is not None:
            setattr(merged, name, value)
    return merged
