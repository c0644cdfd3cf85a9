"""``Routing``: everything one generate call routes with, as one explicit value.

It is built once per call from the call's own generation config (HF makes a per-call copy
of it, so concurrent calls never share one) and handed to the loop. Nothing about a call
lives anywhere else: not on the model, not in a global.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn
from transformers import GenerationConfig

from .capture import CaptureStore, choose_steps
from .engines import Steps


def call_length(generation_config: GenerationConfig, prompt_length: int) -> int:
    """The longest sequence of a call: HF's ``max_length``, and at least one new token."""
    return max(int(generation_config.max_length), prompt_length + 1)


def check_threshold(value: object) -> float:
    """A routing threshold as a float; anything else (a string, a bool, NaN) is refused in one sentence."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or math.isnan(value):
        raise ValueError(f"threshold must be a number (route where score >= threshold), got {value!r}.")
    return float(value)


@dataclass(frozen=True)
class Routing:
    """What one call routes with.

    Args:
        slm, llm: the pair.
        router: scores the SLM's proposals (``router.reset()`` runs once per call).
        vocab_size: the vocabulary both models can write; logits are cut to it.
        num_topk: sorted SLM logits the router reads.
        threshold: route where ``score >= threshold``.
        steps: the call's model calls and caches (eager, compiled or captured; ``capture.py``).
    """

    slm: nn.Module
    llm: nn.Module
    router: nn.Module
    vocab_size: int
    num_topk: int
    threshold: float
    steps: Steps

    @classmethod
    def for_call(
        cls,
        slm: nn.Module,
        llm: nn.Module,
        router: nn.Module,
        vocab_size: int,
        num_topk: int,
        generation_config: GenerationConfig,
        input_ids: torch.Tensor,
        store: CaptureStore | None = None,
    ) -> Routing:
        """The routing of one call; ``generation_config.threshold`` and ``max_length`` are this call's.

        Args:
            slm, llm, router, vocab_size, num_topk: as the fields.
            generation_config: the call's generation config, with ``threshold`` set.
            input_ids: [B, P] the prompts (their shape sizes the caches).
            store: where captured steps are kept between calls (None: always eager).
        """
        threshold = check_threshold(getattr(generation_config, "threshold", None))
        needed = call_length(generation_config, input_ids.shape[1])
        steps = choose_steps(slm, llm, router, num_topk, generation_config, input_ids.shape[0], needed, store)
        return cls(slm, llm, router, vocab_size, num_topk, threshold, steps)
