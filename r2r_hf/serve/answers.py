"""From an OpenAI request body to the answers (``rows.Choice``) it asks for, resolved as ``generate`` resolves.

A choice is one ``generate`` call: its options are the request's fields as ``generate``'s keyword arguments
(vLLM's sampling fields as HF's: ``sampling_fields``), with the server's own defaults (``--threshold``,
``--llm-budget``) where the request names none, and
``model/row_settings.resolve_row`` resolves them (``model.generation_config`` and the router's config below
them, the LLM's processors, the core's checks). Choice ``i`` of a seeded request draws from ``seed + i``.
Everything is checked here, on the request's own thread: a bad option is this request's 400, and never reaches
the decoding thread.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from ..core.sampling import MAX_SEED
from ..model.row_settings import resolve_row, sampling_options
from .policy import request_depth
from .protocol import APIError, ChatRequest, CompletionRequest
from .rows import Choice

COMPLETION_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
# The request fields a resolver complaint may be about, in the order they are looked for in its message.
FIELDS = ("threshold", "llm_budget", "seed", "temperature", "top_p", "top_k", "max_tokens", "repetition_penalty",
          "min_p", "min_tokens", "stop_token_ids")


def sampling_fields(body: CompletionRequest | ChatRequest, default_eos, vocab: int) -> dict[str, Any]:
    """generate's options for vLLM's sampling fields, as its OpenAI server means them: ``min_tokens`` is HF's
    ``min_new_tokens`` (no EOS, and no stop token id, before it), ``stop_token_ids`` end the answer as an EOS does
    (its text left out), ``ignore_eos`` writes on past the model's EOS (``default_eos``: the ids ``generate`` would
    stop at)."""
    options: dict[str, Any] = {}
    for name in ("repetition_penalty", "min_p"):
        if getattr(body, name) is not None:
            options[name] = getattr(body, name)
    if body.min_tokens:
        options["min_new_tokens"] = body.min_tokens
    stops = body.stop_token_ids or []
    if any(not 0 <= t < vocab for t in stops):
        raise APIError(400, f"stop_token_ids holds ids outside the vocabulary [0, {vocab}); send ids of the model's "
                            "tokens.", param="stop_token_ids")
    if stops or body.ignore_eos:
        eos = [] if body.ignore_eos or default_eos is None else [default_eos] if isinstance(default_eos, int) \
            else list(default_eos)
        eos += [t for t in stops if t not in eos]
        options["eos_token_id"] = eos or None
    return options


def max_tokens(body: CompletionRequest | ChatRequest, prompt_tokens: int, context: int | None,
               default_max_tokens: int | None) -> int:
    """New tokens an answer may write: asked, or the default (the context left, for chat), within the context, and
    at least ``min_tokens``."""
    chat = isinstance(body, ChatRequest)
    asked = (body.max_completion_tokens or body.max_tokens) if chat else body.max_tokens
    room = None if context is None else context - prompt_tokens
    if room is not None and room < 1:
        raise APIError(400, f"The prompt has {prompt_tokens} tokens, the models' context is {context}; shorten it.",
                       param="messages" if chat else "prompt", code="context_length_exceeded")
    default = (default_max_tokens or room) if chat else COMPLETION_DEFAULT_MAX_TOKENS
    tokens = asked or default or 256
    if room is not None and tokens > room:
        if asked:
            raise APIError(400, f"The prompt has {prompt_tokens} tokens; with max_tokens={asked} it exceeds the "
                                f"models' context of {context} tokens. Lower max_tokens or shorten the prompt.",
                           param="max_tokens", code="context_length_exceeded")
        tokens = room
    if body.min_tokens > tokens:  # (vLLM refuses it too: no answer could write them)
        limit = f"max_tokens={tokens}" if asked else f"the {tokens} tokens this answer may write (no max_tokens sent)"
        raise APIError(400, f"min_tokens={body.min_tokens} is more than {limit}; send min_tokens of at most {tokens} "
                            "or a larger max_tokens.", param="min_tokens")
    return tokens


def choices(service, body: CompletionRequest | ChatRequest, prompt: list[int]) -> list[Choice]:
    """The ``body.n`` answers the request asks for on ``prompt``."""
    if body.seed is not None and isinstance(body.seed, int) and body.seed + body.n - 1 > MAX_SEED:
        raise APIError(400, f"seed + n - 1 = {body.seed + body.n - 1} exceeds 2**63 - 1 (choice i draws from seed + i); "
                            "lower seed or n.", param="seed")
    options: dict[str, Any] = sampling_options(body.temperature, body.top_p, body.top_k)
    options["max_new_tokens"] = max_tokens(body, len(prompt), service.context, service.settings.default_max_tokens)
    options |= sampling_fields(body, service.model.generation_config.eos_token_id, service.vocab)
    for name, default in (("threshold", service.settings.threshold), ("llm_budget", service.settings.llm_budget)):
        value = getattr(body, name)
        if value is not None or default is not None:
            options[name] = value if value is not None else default
    depth = request_depth(body.speculate, service.engine.policy, service.settings.speculate)
    out = []
    for i in range(body.n):
        seed = None if body.seed is None else body.seed + i
        try:
            settings = resolve_row(service.model, prompt, **options, **({} if seed is None else {"seed": seed}))
        except ValueError as err:
            message = str(err)
            param = next((f for f in FIELDS if f in message), None)
            raise APIError(400, message, param=param) from None
        out.append(Choice(dataclasses.replace(settings, speculate=depth), tuple(body.stop)))
    return out
