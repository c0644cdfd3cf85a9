"""The OpenAI API as the server speaks it: request bodies (validated), errors, answers and stream chunks.

Requests are checked field by field with pydantic: a wrong type or value is a 400 naming the
field. OpenAI options R2R cannot honour (log-probabilities, penalties, logit bias, tools, echo...)
are refused by name when set to anything but their neutral value; fields OpenAI clients send that
change no answer (``user``, ``metadata``...: ``IGNORED``) are taken and ignored; any other field is refused by
name. R2R's own options arrive as top-level fields (what the openai client sends through ``extra_body``):
``threshold``, ``llm_budget``, ``speculate`` (this answer's speculation depth: 0 turns it off, at most the
server's ``--speculate``); so do the sampling fields of vLLM's OpenAI server (``top_k``, ``min_p``,
``repetition_penalty``, ``min_tokens``, ``ignore_eos``, ``stop_token_ids``), honoured as ``generate`` honours
its HF options (``answers.py``).
"""

from __future__ import annotations

import math
import time
import uuid
from difflib import get_close_matches
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator

from .errors import APIError

# OpenAI options R2R cannot honour, with the value that means "off".
UNSUPPORTED = {
    "logprobs": (None, False), "top_logprobs": (None, 0), "logit_bias": (None, {}), "presence_penalty": (None, 0, 0.0),
    "frequency_penalty": (None, 0, 0.0), "echo": (None, False), "suffix": (None, ""), "best_of": (None, 1),
    "tools": (None, []), "functions": (None, []), "response_format": (None, {"type": "text"}),
    "tool_choice": (None, "none", "auto"), "function_call": (None, "none", "auto"),  # with no tools, no choice
}
# Fields OpenAI's API defines that no answer depends on: taken and ignored.
IGNORED = ("user", "metadata", "store", "service_tier", "parallel_tool_calls", "prompt_cache_key", "safety_identifier")
# A field of the other endpoint, with what this one takes instead.
OTHER_ENDPOINT = {"max_completion_tokens": "max_tokens"}
MAX_N = 16  # choices per request (each is a row of the batch)
MAX_STOPS = 4  # OpenAI's limit
RANGES = {"temperature": "between 0 and 2", "top_p": "above 0 and at most 1", "repetition_penalty": "above 0",
          "min_p": "between 0 and 1"}


class _Common(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)

    model: str
    n: int = Field(1, ge=1, le=MAX_N)
    stream: bool = False
    stream_options: dict[str, Any] | None = None
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=0)
    stop: str | list[str] | None = Field(None, validate_default=True)
    # No ranges here: the core's checks (check_seed, check_threshold, check_budget) are the only ones, applied
    # where the answer is resolved (answers.py), so the server and generate refuse the same values.
    seed: int | None = None
    max_tokens: int | None = Field(None, ge=1)
    threshold: float | None = None
    llm_budget: float | None = None
    speculate: int | None = None  # (checked against the server's depth in answers.choices)
    # vLLM's sampling fields (``answers.sampling_fields`` turns them into generate's options).
    repetition_penalty: float | None = Field(None, gt=0)
    min_p: float | None = Field(None, ge=0, le=1)
    min_tokens: int = Field(0, ge=0)
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None

    @field_validator("temperature", "top_p", "repetition_penalty", "min_p", mode="before")
    @classmethod
    def _not_nan(cls, value: Any, info: ValidationInfo) -> Any:
        # NaN fails every range check, so pydantic's own message ("less than or equal to 2") would mislead.
        if isinstance(value, float) and math.isnan(value):
            raise ValueError(f"NaN is not a number; send {info.field_name} as a number {RANGES[info.field_name]}")
        return value

    @field_validator("stop")
    @classmethod
    def _stops(cls, value: str | list[str] | None) -> list[str]:
        stops = [value] if isinstance(value, str) else list(value or [])
        if len(stops) > MAX_STOPS or any(not s for s in stops):
            raise ValueError(f"stop takes at most {MAX_STOPS} non-empty strings")
        return stops

    @field_validator("stream_options")
    @classmethod
    def _stream_options(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        if value is not None and not isinstance(value.get("include_usage", False), bool):
            raise ValueError("stream_options.include_usage must be true or false")
        return value

    def refuse_unsupported(self) -> None:
        """A 400 naming the first field this server cannot honour (``UNSUPPORTED`` set to anything but neutral) or
        does not know at all."""
        for name, neutral in UNSUPPORTED.items():
            value = (self.model_extra or {}).get(name, getattr(self, name, None))
            if value not in neutral:
                raise APIError(400, f"{name}={value!r} is not supported by this R2R server; remove it.", param=name,
                               code="unsupported_parameter")
        for name in self.model_extra or {}:
            if name not in UNSUPPORTED and name not in IGNORED:
                raise APIError(400, self._unknown(name), param=name, code="unknown_parameter")

    def _unknown(self, name: str) -> str:
        """One sentence on a field this endpoint does not take."""
        if name in OTHER_ENDPOINT and OTHER_ENDPOINT[name] in type(self).model_fields:
            return f"{name} is a chat completions field: /v1/completions takes {OTHER_ENDPOINT[name]}; rename it."
        known = [*type(self).model_fields, *IGNORED]
        close = get_close_matches(name, known, n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        return f"{name!r} is not a field this server takes{hint}; remove it."

    @property
    def include_usage(self) -> bool:
        return bool((self.stream_options or {}).get("include_usage", False))


class CompletionRequest(_Common):
    """``POST /v1/completions``: a prompt (text or token ids; several give several answers each)."""

    prompt: str | list[str] | list[int] | list[list[int]]

    @field_validator("prompt")
    @classmethod
    def _text(cls, value: str | list[str] | list[int] | list[list[int]]) -> Any:
        for text in [value] if isinstance(value, str) else value:
            if isinstance(text, str):
                _refuse_surrogates(text)
        return value


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)

    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: str | list[dict[str, Any]] | None = None

    @field_validator("content")
    @classmethod
    def _text(cls, value: str | list[dict[str, Any]] | None) -> Any:
        for text in [value] if isinstance(value, str) else [part.get("text") for part in value or []]:
            if isinstance(text, str):
                _refuse_surrogates(text)
        return value

    def text(self) -> str:
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        parts = []
        for part in self.content:
            if part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise APIError(400, f"message content of type {part.get('type')!r} is not supported; send text.",
                               param="messages")
            parts.append(part["text"])
        return "".join(parts)


class ChatRequest(_Common):
    """``POST /v1/chat/completions``: messages rendered with the SLM tokenizer's chat template."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)


def _refuse_surrogates(text: str) -> None:
    """Refuse a lone UTF-16 surrogate (valid JSON, ``"\\ud800"``, but no text: the tokenizer cannot encode it)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as err:
        raise ValueError(f"character {err.start} is a lone UTF-16 surrogate ({text[err.start]!a}), which is not text; "
                         "send valid Unicode") from None


def validation_error(errors: list[dict[str, Any]]) -> APIError:
    """pydantic's first complaint as one OpenAI-style 400."""
    first = errors[0] if errors else {"loc": (), "msg": "invalid request"}
    if first.get("type") == "json_invalid":
        return APIError(400, f"The request body is not valid JSON ({first.get('ctx', {}).get('error', 'cannot parse')}).")
    loc = [str(p) for p in first.get("loc", ()) if p != "body"]
    param = ".".join(loc) or None
    message = first.get("msg", "invalid value").removeprefix("Value error, ")  # pydantic's prefix says nothing
    return APIError(400, f"{param}: {message}" if param else message, param=param)


# ----------------------------------------------------------------- answers
def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def routing_stats(llm_tokens: int, generated: int, threshold: float, budget: float | None = None) -> dict[str, Any]:
    """The ``r2r`` object of an answer: who wrote how many of its tokens.

    A threshold that is not finite (``inf``: never route) is the string ``"inf"`` (``"-inf"``): JSON has no infinity.
    """
    stats = {"llm_tokens": llm_tokens, "generated_tokens": generated,
             "llm_token_rate": llm_tokens / generated if generated else 0.0,
             "threshold": threshold if math.isfinite(threshold) else str(threshold)}
    if budget is not None:
        stats["llm_budget"] = budget
    return stats


def usage(prompt_tokens: int, completion_tokens: int, speculation: dict[str, int] | None = None) -> dict[str, Any]:
    """OpenAI's usage, with what speculation did for the request's answers where the server speculates
    (``core.ledger.Speculated``: pending positions resolved, agreed, rejected, committed tokens thrown away)."""
    out: dict[str, Any] = {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                           "total_tokens": prompt_tokens + completion_tokens}
    if speculation is not None:
        out["speculation"] = speculation
    return out


def answer(chat: bool, rid: str, model: str, texts: list[str], reasons: list[str], use: dict, r2r: dict) -> dict:
    """A whole (non-streamed) answer."""
    if chat:
        choices = [{"index": i, "message": {"role": "assistant", "content": t}, "finish_reason": r, "logprobs": None}
                   for i, (t, r) in enumerate(zip(texts, reasons))]
    else:
        choices = [{"index": i, "text": t, "finish_reason": r, "logprobs": None}
                   for i, (t, r) in enumerate(zip(texts, reasons))]
    return {"id": rid, "object": "chat.completion" if chat else "text_completion", "created": int(time.time()),
            "model": model, "choices": choices, "usage": use, "r2r": r2r}


def chunk(chat: bool, rid: str, model: str, index: int | None, text: str | None = None,
          reason: str | None = None, first: bool = False, **extra: Any) -> dict:
    """One stream chunk: a piece of choice ``index``, its finish reason, or (index None) no choice."""
    choices = []
    if index is not None:
        if chat:
            delta = {"role": "assistant", "content": text or ""} if first else ({"content": text} if text else {})
            choices = [{"index": index, "delta": delta, "finish_reason": reason, "logprobs": None}]
        else:
            choices = [{"index": index, "text": text or "", "finish_reason": reason, "logprobs": None}]
    return {"id": rid, "object": "chat.completion.chunk" if chat else "text_completion", "created": int(time.time()),
            "model": model, "choices": choices, **extra}
