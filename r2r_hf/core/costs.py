"""An LLM forward's cost in SLM steps, measured on the pair's own device: what the expected-gain rule weighs
(``WaitPolicy.draft_cost``, ``moves.draft_ends``) where a caller asks for ``draft_cost="auto"``.

The ratio depends on the pair and on where it runs (on the 2-core CPU of benchmarks/results/lossless.md: 2.5 for
Qwen2.5-Coder 0.5B + 1.5B in bf16; with the first H200 run's costs 5.6-7.8 for R1-Distill 1.5B + 32B), and the
parameter counts guess it badly (3.1 and 21 there: a GPU reads small models' weights faster than their counts say
and launches as many kernels for each), so it is timed: the LLM's read of a draft (``VERIFY_TOKENS``) over the
SLM's one-token step, each after a short context, the median of a few, once per model, shape, dtype and device
(kept in the core's notes on the model). Where a draft ends never changes what the LLM writes, so the measured value
moves the speed only, never an answer.
"""

from __future__ import annotations

import statistics
import time

import torch

from .features import input_device
from .layouts.model_calls import cached_forward, make_cache
from .notes import notes
from .pair import RoutedPair
from .policy import MEASURED_COST

VERIFY_TOKENS = 9  # a draft of 8 and the LLM's own token: what a verifying read holds
CONTEXT = 16  # tokens the model has read before the timed forward
REPEATS = 3  # timed forwards per model (their median), after one untimed


def forward_seconds(model: torch.nn.Module, tokens: int, stepwise: str | None = None, context: int = CONTEXT,
                    repeats: int = REPEATS) -> float:
    """Seconds ``model`` takes to read ``tokens`` after ``context`` (its cached read, as the loop runs it: one
    forward, or one per token where it cannot continue its cache's state: ``stepwise``, its
    ``Abilities.continues``), timed once per dtype and device and kept (a model cast or moved is timed again)."""
    weight = next(model.parameters())
    known, key = notes(model), ("forward_seconds", tokens, context, weight.dtype, weight.device)
    if key not in known:
        known[key] = _timed(model, tokens, stepwise, context, repeats)
    return known[key]


def _timed(model: torch.nn.Module, tokens: int, stepwise: str | None, context: int, repeats: int) -> float:
    device = input_device(model)
    ids = (torch.arange(context + tokens, device=device) % 64 + 1)[None]  # (any ids: the cost is the shape's)
    positions = torch.arange(context + tokens, device=device)[None]
    seconds = []
    with torch.inference_mode():
        for _ in range(repeats + 1):  # (the first pays one-time work: not counted)
            cache = make_cache(model, None, context + tokens)
            cached_forward(model, ids[:, :context], positions[:, :context], cache, 1, _unmasked, stepwise)
            _synchronize(device)
            start = time.perf_counter()
            cached_forward(model, ids[:, context:], positions[:, context:], cache, 1, _unmasked, stepwise)
            _synchronize(device)
            seconds.append(time.perf_counter() - start)
    return statistics.median(seconds[1:])


def _unmasked(start: int, stop: int) -> None:  # (one row, nothing padded)
    return None


def _synchronize(device: torch.device) -> None:
    if device.type != "cpu":
        getattr(torch, device.type).synchronize(device)


def measured_draft_cost(pair: RoutedPair) -> float:
    """The LLM's read of a draft (``VERIFY_TOKENS``) in the SLM's one-token steps, on the models' own devices."""
    stepwise = pair.abilities.stepwise
    return forward_seconds(pair.llm, VERIFY_TOKENS, stepwise["llm"]) / forward_seconds(pair.slm, 1, stepwise["slm"])


def resolved_draft_cost(value: object, pair: RoutedPair) -> object:
    """``value`` (a ``draft_cost`` as given), the pair's measured ratio where it is ``MEASURED_COST``."""
    return measured_draft_cost(pair) if value == MEASURED_COST else value
