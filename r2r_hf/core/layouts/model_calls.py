"""The rectangle's model calls (``rectangle.ModelCalls``) as plain forwards over HF's caches, dynamic or static.

``fast/static_reads.CapturedCalls`` replays the same calls captured, and ``fast/store.choose_calls`` decides which
a generate call gets.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache, DynamicCache, StaticCache

from ...compat import crop_cache
from ..features import HiddenStateCapture, lm_forward, read_features, score
from .rectangle import Committed


def make_cache(model: torch.nn.Module, implementation: str | None, length: int) -> Cache:
    """A fresh KV cache for one model; R2R never crops, so a static cache is always allowed."""
    if implementation == "static":
        return StaticCache(config=model.config, max_cache_len=length)
    return DynamicCache(config=model.config)



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

    def llm_predict(self, seq: Committed, start: int, end: int, keep: list[int]) -> torch.Tensor:
        """The LLM reads columns ``start:end``; its logits [B, n, V] after each column of ``keep`` (computed there
        only: HF's ``logits_to_keep`` takes the positions)."""
        at = torch.tensor([c - start for c in keep], device=seq.ids.device)
        return lm_forward(self.llm, seq.ids[:, start:end], seq.mask_upto(end), seq.positions[:, start:end],
                          self.llm_cache, logits_to_keep=at)

    def crop(self, slm_tokens: int, llm_tokens: int) -> None:
        """Each model's cache drops its last tokens (a rollback)."""
        crop_cache(self.slm_cache, slm_tokens)
        crop_cache(self.llm_cache, llm_tokens)

    def close(self) -> None:
        pass
