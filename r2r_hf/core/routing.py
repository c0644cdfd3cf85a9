"""``Routing``: everything one decoding batch routes with, as one explicit value.

It is built once per call from the call's own generation config (HF makes a per-call copy of it, so
concurrent calls never share one) and handed to the loop. Nothing about a call lives anywhere else:
not on the model, not in a global. (The server's rows carry their own settings: ``batch.Joiner``.)
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch
from transformers import GenerationConfig

from .budget import check_budget
from .fast.store import CaptureStore, choose_calls
from .layouts.model_calls import EagerCalls
from .layouts.rectangle import ModelCalls
from .pair import RoutedPair
from .policy import IMMEDIATE, WaitPolicy, call_policy, say_once
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


def fixed_routing(threshold: float, llm_budget: float | None, scored: bool = False) -> bool | None:
    """Whether a row routes every proposal (True) or none (False) whatever the router says, or None where the router
    decides. Router scores lie in [0, 1]: at a threshold <= 0 every position routes (a budget could refuse one: it
    spends by the scores), above 1 none does; there the router need not run (``RunningBatch.propose``), unless the
    scores themselves are asked for (``scored``: ``generate``'s record at a threshold that routes nothing is how a
    threshold is chosen; at one that routes everything nothing is scored, its record holds NaN)."""
    if threshold <= 0 and llm_budget is None:
        return True
    if threshold > 1 and not scored:
        return False
    return None


@dataclass(frozen=True)
class Routing:
    """What one batch routes with.

    Args:
        pair: the models and this call's router (``RoutedPair.for_call``: per-call router state is this call's own).
        threshold: route where ``score >= threshold``.
        processors: HF's logits processors, applied to both models' logits.
        sampler: argmax or draws; its random stream advances once per committed token.
        calls: the batch's model calls and caches (eager, compiled or captured: ``fast/store.py``).
        llm_budget: the share of each answer's tokens the LLM may write (inf: none), or None for no budget at all
            (``budget.py``).
        policy: when the LLM runs, and whether rows speculate past routed positions (``policy.call_policy``).
    """

    pair: RoutedPair
    threshold: float
    processors: Processors
    sampler: Sampler
    calls: ModelCalls
    llm_budget: float | None = None
    policy: WaitPolicy = IMMEDIATE

    @property
    def vocab_size(self) -> int:
        """The vocabulary both models can write; logits are cut to it."""
        return self.pair.vocab_size

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
            store: where captured calls are kept between generate calls (None: always eager).
        """
        threshold = check_threshold(getattr(generation_config, "threshold", None))
        budget = getattr(generation_config, "llm_budget", None)
        budget = None if budget is None else check_budget(budget)
        seed = getattr(generation_config, "seed", None)
        generator = None if seed is None else seeded_generator(seed, input_ids.device)
        sampler = Sampler(bool(generation_config.do_sample), input_ids.device, generator)
        pair = pair.for_call(seed)
        needed = call_length(generation_config, input_ids.shape[1])
        scored = bool(generation_config.return_dict_in_generate)  # (r2r_decode also counts a RoutingAwareStreamer)
        fold = proposal_is_argmax(sampler.do_sample, processors) and fixed_routing(threshold, budget, scored) is None
        policy = speculation_for(call_policy(generation_config, input_ids.shape[0]), pair)
        calls = choose_calls(pair, generation_config, input_ids.shape[0], needed, store, fold, policy.horizon)
        return cls(pair, threshold, processors, sampler, calls, budget, policy)

    @classmethod
    def eager(cls, pair: RoutedPair, threshold: float, processors: Processors, sampler: Sampler, length: int,
              llm_budget: float | None = None, rollback: int = 0) -> Routing:
        """One answer's routing on HF's dynamic caches (the server's answers for models that cannot use slots);
        ``rollback``: the most tokens the answer's rollbacks cut its caches back by (``WaitPolicy.horizon``; 0: it
        does not speculate)."""
        calls = EagerCalls(pair.slm, pair.llm, pair.router, pair.num_topk, None, length, rollback=rollback,
                           stepwise=pair.abilities.stepwise)
        return cls(pair, threshold, processors, sampler, calls, llm_budget)


def speculation_for(policy: WaitPolicy, pair: RoutedPair, slots: bool = False) -> WaitPolicy:
    """``policy``, without speculation where a model of the pair cannot be cut back where it decodes (in ``slots``, or
    on HF's caches; said once: ``PairAbilities.speculation``); the answers are the same, only speculation's saving is
    lost."""
    if not policy.speculate:
        return policy
    problem = pair.abilities.speculation(slots)
    if problem is None:
        return policy
    say_once(problem)
    return replace(policy, speculate=0, speculate_below=math.inf, draft_confidence=0.0, depths=(), draft_cost=0.0)
