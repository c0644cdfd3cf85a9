"""The values that travel together through a call: the model pair, and the pair with the router it routes by.

``R2RForCausalLM`` holds its ``ModelPair`` as a plain attribute, not as submodules, on purpose: ``.to()``,
``.half()``, ``parameters()``, ``state_dict()``, HF's weight initialisation and ``save_pretrained`` then touch
the router alone, so a router checkpoint stays small and a dispatched or quantised LLM (``device_map``,
bitsandbytes) is never moved or cast with it. (``nn.Module.__setattr__`` stores a non-Module value as is.)
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from torch import nn


@dataclass(frozen=True, eq=False)
class ModelPair:
    """The SLM and the LLM, and the vocabulary both can write (``vocab_size``: ids a sampler may draw)."""

    slm: nn.Module
    llm: nn.Module
    vocab_size: int


@dataclass(frozen=True, eq=False)
class RoutedPair:
    """What one call's steps run: the pair, the router, how many sorted SLM logits the router reads, and what the
    models can do (a ``core.abilities.PairAbilities``: which fast paths they take, and why not)."""

    slm: nn.Module
    llm: nn.Module
    router: nn.Module
    num_topk: int
    vocab_size: int
    abilities: Any

    def for_call(self, seed: int | None = None) -> RoutedPair:
        """The same pair with the router's per-call form (``Router.for_call``); ``seed``, the call's, keys the draws
        of a router that draws per row (``RandomRouter``)."""
        per_row = getattr(self.router, "per_row", False)
        return dataclasses.replace(self, router=self.router.for_call(seed) if per_row else self.router.for_call())
