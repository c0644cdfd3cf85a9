"""The model calls of the R2R loop: their interface, and the eager engine.

Every engine offers the same three calls over its own KV caches:

* ``slm_read(seq, start)``  the SLM reads ``seq[start:]``; its next-token logits and post-norm hidden state;
* ``route_scores(logits, hidden, token)``  the router's scores for the SLM's proposed tokens;
* ``llm_read(seq, start)``  the LLM catches up on ``seq[start:]`` in one forward; its next-token logits.

``EagerCalls`` (here) runs them as plain forwards over a dynamic or static cache.
``capture.CapturedCalls`` replays captured ones, and ``capture_store.choose_calls`` decides
which engine a call gets. ``close()`` ends the call's use of the engine (captured steps go back
to their store).
"""

from __future__ import annotations

from typing import Protocol

import torch
from transformers.cache_utils import Cache

from ..features import HiddenStateCapture, lm_forward, read_features, score
from .rectangle import Committed, make_cache


class ModelCalls(Protocol):
    """The three model calls of one generate call (see the module docstring)."""

    capacity: int  # columns the call's buffers and caches hold

    def slm_read(self, seq: Committed, start: int) -> tuple[torch.Tensor, torch.Tensor]: ...

    def route_scores(self, logits: torch.Tensor, hidden: torch.Tensor, token: torch.Tensor) -> torch.Tensor: ...

    def llm_read(self, seq: Committed, start: int) -> torch.Tensor: ...

    def close(self) -> None: ...


def route_scores(slm: torch.nn.Module, router: torch.nn.Module, k: int, logits, hidden, token) -> torch.Tensor:
    """Router scores [B] for the SLM's proposals ``token`` given its logits [B, V] and hidden state [B, H]."""
    return score(router, read_features(slm, logits, hidden, token, k))


class EagerCalls:
    """Plain forwards over a dynamic or static cache per model (fresh for every call).

    Args:
        slm, llm, router: the pair and the router.
        num_topk: sorted SLM logits the router reads.
        cache_implementation: ``"static"`` or anything else for a dynamic cache.
        capacity: the call's longest sequence (static caches are this long).
        caches: (SLM cache, LLM cache) to read into instead of fresh ones (the captured engine's).
    """

    def __init__(self, slm, llm, router, num_topk: int, cache_implementation: str | None, capacity: int,
                 caches: tuple[Cache, Cache] | None = None) -> None:
        self.slm, self.llm, self.router, self.num_topk, self.capacity = slm, llm, router, num_topk, capacity
        if caches is None:
            caches = make_cache(slm, cache_implementation, capacity), make_cache(llm, cache_implementation, capacity)
        self.slm_cache, self.llm_cache = caches

    def slm_read(self, seq: Committed, start: int) -> tuple[torch.Tensor, torch.Tensor]:
        end = seq.length
        with HiddenStateCapture(self.slm) as capture:
            logits = lm_forward(self.slm, seq.ids[:, start:end], seq.mask_upto(end), seq.positions[:, start:end],
                                self.slm_cache)
            return logits[:, -1], capture.hidden[:, -1]

    def route_scores(self, logits: torch.Tensor, hidden: torch.Tensor, token: torch.Tensor) -> torch.Tensor:
        return route_scores(self.slm, self.router, self.num_topk, logits, hidden, token)

    def llm_read(self, seq: Committed, start: int) -> torch.Tensor:
        end = seq.length
        logits = lm_forward(self.llm, seq.ids[:, start:end], seq.mask_upto(end), seq.positions[:, start:end],
                            self.llm_cache)
        return logits[:, -1]

    def close(self) -> None:
        pass
