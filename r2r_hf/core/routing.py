"""``Routing``: everything one decoding batch routes with, as one explicit value.

It is built once per call from the call's own generation config (HF makes a per-call copy of it, so
concurrent calls never share one) and handed to the loop. Nothing about a call lives anywhere else:
not on the model, not in a global. (The server's rows carry their own settings: ``batch.py``.)
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn
from transformers import GenerationConfig

from .budget import check_budget
from .fast.store import CaptureStore, choose_steps
from .layouts.model_calls import Steps
from .pair import RoutedPair
from .fast.router_copy import proposal_is_argmax
from .sampling import Sampler, seeded_generator
from .choice import Processors


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
    """What one batch routes with.

    Args:
        router: scores the SLM's proposals (``router.for_call()``: per-call state is this call's own).
        vocab_size: the vocabulary both models can write; logits are cut to it.
        threshold: route where ``score >= threshold``.
        processors: HF's logits processors, applied to both models' logits.
        sampler: argmax or draws; its random stream advances once per committed token.
        steps: the batch's model calls and caches (eager, compiled or captured; ``capture.py``).
        llm_budget: the share of each answer's tokens the LLM may write (inf: none), or None for no budget at all
            (``budget.py``).
        pair: the models and this call's router (``RoutedPair.for_call``).
    """

    router: nn.Module
    vocab_size: int
    threshold: float
    processors: Processors
    sampler: Sampler
    steps: Steps
    llm_budget: float | None = None
    pair: RoutedPair | None = None

    @classmethod
    def for_call(
        cls,
        pair: RoutedPair,
        generation_config: GenerationConfig,
        processors: Processors,
        input_ids: torch.Tensor,
        store: CaptureStore | None = None,
    ) -> Routing:
        """The routing of one ``generate`` call; ``generation_config`` is the call's own copy.

        Args:
            pair: the models, the router and the logits it reads.
            generation_config: the call's generation config, with ``threshold`` (and maybe ``seed``, ``llm_budget``).
            processors: the call's logits processors.
            input_ids: [B, P] the prompts (their shape sizes the caches).
            store: where captured steps are kept between calls (None: always eager).
        """
        threshold = check_threshold(getattr(generation_config, "threshold", None))
        budget = getattr(generation_config, "llm_budget", None)
        budget = None if budget is None else check_budget(budget)
        seed = getattr(generation_config, "seed", None)
        generator = None if seed is None else seeded_generator(seed, input_ids.device)
        sampler = Sampler(bool(generation_config.do_sample), input_ids.device, generator)
        pair = pair.for_call()
        needed = call_length(generation_config, input_ids.shape[1])
        fold = proposal_is_argmax(sampler.do_sample, processors)
        steps = choose_steps(pair, generation_config, input_ids.shape[0], needed, store, fold)
        return cls(pair.router, pair.vocab_size, threshold, processors, sampler, steps, budget, pair)
