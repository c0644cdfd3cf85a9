"""The rectangle's model calls (``rectangle.ModelCalls``) as plain forwards over HF's caches, dynamic or static.

``fast/static_reads.CapturedCalls`` replays the same calls captured, and ``fast/store.choose_calls`` decides which
a generate call gets. What differs by family is read off the model here: how its layers read the mask
(``read_mask``), where a long-RoPE model reads everything again (``read_start``), what its layers keep
(``layer_kinds``). Whether it can take a path at all is its ``Abilities`` (``core/abilities.py``);
docs/model_families.md shows what each family gets on each path.
"""

from __future__ import annotations

import torch
from transformers import cache_utils
from transformers.cache_utils import Cache, DynamicCache, DynamicLayer, StaticCache, StaticLayer

from ...compat import LINEAR, crop_cache, hold_states, restore_states
from ..features import HiddenStateCapture, lm_forward, read_features, score
from ..notes import notes
from .rectangle import Committed



def make_cache(model: torch.nn.Module, implementation: str | None, length: int, rollback: bool = False) -> Cache:
    """A fresh KV cache for one model: ``static_cache`` for ``"static"``, else HF's dynamic cache; where the call may
    ``rollback`` (speculation cuts the caches back), ``keeping_past``: a layer that dropped what fell out of its
    window could not be cut back past it."""
    cache = static_cache(model.config, length) if implementation == "static" else DynamicCache(config=model.config)
    return keeping_past(cache) if rollback else cache


def keeping_past(cache: Cache) -> Cache:
    """``cache``, its windowed layers keeping what they would drop until a cut (``crop``) tells them how far back to
    keep it (HF's own rollback mode for assisted decoding). Its recurrent and convolution layers go back to a
    checkpoint instead (``EagerCalls.keep``): exact on every release, and no per-token history of their states."""
    for layer in cache.layers:
        if hasattr(layer, "activate_past_recording") and not isinstance(layer, LINEAR):
            layer.activate_past_recording()
    return cache


def static_cache(config, length: int) -> StaticCache:
    """HF's static cache of ``length`` columns, its windowed (and chunked) layers holding every column too: the
    windows live in the masks HF builds from the config, a rollback moves a device length back (a windowed static
    layer rolls its columns and counts on the host: it can neither be cut back past its window nor captured)."""
    cache = StaticCache(config=config, max_cache_len=length)
    for i, layer in enumerate(cache.layers):
        windowed = isinstance(layer, StaticLayer) and getattr(layer, "is_sliding", False)
        if windowed and not isinstance(layer, LINEAR):  # (a hybrid layer keeps its recurrent half: not captured)
            cache.layers[i] = StaticLayer(max_cache_len=length)
    return cache


def read_mask(model: torch.nn.Module, cache: Cache, seq: Committed, start: int, end: int) -> torch.Tensor | None:
    """The attention mask of a read of columns ``start:end`` into ``cache``, as the model's layers read it: over
    every column up to ``end``; as wide as a static cache's keys where every layer attends (a model that builds
    position biases from the mask, as BLOOM's ALiBi, needs it that wide, and a captured read passes the same); over
    the read's own columns where no layer attends (a state-space model's mixer zeroes its padded inputs: HF passes
    it the prompt's mask, then none)."""
    kinds = layer_kinds(model)
    if "attention" not in kinds:
        mask = seq.mask_upto(end)
        return None if mask is None else mask[:, start:end]
    wide = isinstance(cache, StaticCache) and "recurrent" not in kinds
    return seq.mask_upto(seq.mask.shape[1] if wide else end)


def read_start(model: torch.nn.Module, cache: Cache, start: int, end: int) -> int:
    """The column a read of ``start:end`` begins at: ``start``, or 0 with ``cache`` emptied where the read takes a
    long-RoPE model past its original context while the cache holds none of what lies past it (what its own
    ``generate`` does there: every key read again with the long factors)."""
    switch = long_rope_switch(model)
    if switch is not None and 0 < start <= switch < end:
        cache.reset()
        return 0
    return start


def layer_kinds(model: torch.nn.Module) -> frozenset[str]:
    """What ``model``'s layers keep in its cache: ``"attention"`` (keys and values of past tokens) and/or
    ``"recurrent"`` (a state-space or convolution state)."""
    known = notes(model)
    if "layer_kinds" not in known:
        layers = DynamicCache(config=model.config).layers
        kinds = {"attention" for layer in layers if not isinstance(layer, LINEAR) or isinstance(layer, DynamicLayer)}
        kinds |= {"recurrent" for layer in layers if isinstance(layer, LINEAR)}
        known["layer_kinds"] = frozenset(kinds or {"attention"})
    return known["layer_kinds"]


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
        rollback: the call may cut its caches back (speculation: ``make_cache``).
    """

    def __init__(self, slm, llm, router, num_topk: int, cache_implementation: str | None, capacity: int,
                 caches: tuple[Cache, Cache] | None = None, rollback: bool = False) -> None:
        self.slm, self.llm, self.router, self.num_topk, self.capacity = slm, llm, router, num_topk, capacity
        if caches is None:
            caches = tuple(make_cache(m, cache_implementation, capacity, rollback) for m in (slm, llm))
        self.slm_cache, self.llm_cache = caches
        self.held: dict[str, list] = {}  # each model's checkpoint of its recurrent states (``keep``)

    def slm_read(self, seq: Committed, start: int) -> tuple[torch.Tensor, torch.Tensor]:
        end = seq.length
        start = read_start(self.slm, self.slm_cache, start, end)
        with HiddenStateCapture(self.slm) as capture:
            logits = lm_forward(self.slm, seq.ids[:, start:end], read_mask(self.slm, self.slm_cache, seq, start, end),
                                seq.positions[:, start:end], self.slm_cache)
            return logits[:, -1], capture.hidden[:, -1]

    def route_scores(self, logits: torch.Tensor, hidden: torch.Tensor, token: torch.Tensor) -> torch.Tensor:
        return route_scores(self.slm, self.router, self.num_topk, logits, hidden, token)

    def llm_read(self, seq: Committed, start: int) -> torch.Tensor:
        end = seq.length
        start = read_start(self.llm, self.llm_cache, start, end)
        logits = lm_forward(self.llm, seq.ids[:, start:end], read_mask(self.llm, self.llm_cache, seq, start, end),
                            seq.positions[:, start:end], self.llm_cache)
        return logits[:, -1]

    def llm_predict(self, seq: Committed, start: int, end: int, keep: list[int]) -> torch.Tensor:
        """The LLM reads columns ``start:end``; its logits [B, n, V] after each column of ``keep`` (computed there
        only: HF's ``logits_to_keep`` takes the positions)."""
        start = read_start(self.llm, self.llm_cache, start, end)
        at = torch.tensor([c - start for c in keep], device=seq.ids.device)
        return lm_forward(self.llm, seq.ids[:, start:end], read_mask(self.llm, self.llm_cache, seq, start, end),
                          seq.positions[:, start:end], self.llm_cache, logits_to_keep=at)

    def keep(self, role: str) -> None:
        """Checkpoint ``role``'s recurrent and convolution states (``crop`` can put them back)."""
        self.held[role] = hold_states(self.slm_cache if role == "slm" else self.llm_cache)

    def crop(self, slm_tokens: int, llm_tokens: int, restore: tuple[str, ...] = ()) -> None:
        """Each model's cache drops its last tokens (a rollback); the models in ``restore`` have their recurrent
        states put back to their checkpoint (``keep``: taken where the crop leaves them)."""
        for role, cache, tokens in (("slm", self.slm_cache, slm_tokens), ("llm", self.llm_cache, llm_tokens)):
            crop_cache(cache, tokens)
            if role in restore:
                restore_states(cache, self.held[role])

    def close(self) -> None:
        pass


# ------------------------------------------------------------------ what differs by family
def long_rope_switch(model: torch.nn.Module) -> int | None:
    """Where a long-RoPE model (Phi-3-mini-128k, Phi-3.5, Phi-4-mini) switches to its long rotary factors: its
    original context (None for any other model). Its factors follow the longest position of each forward, so its
    own ``generate`` reads the whole sequence again where the sequence first runs past it (``read_start``)."""
    config = model.config
    rope = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    if not isinstance(rope, dict) or rope.get("rope_type", rope.get("type")) != "longrope":
        return None
    return (rope.get("original_max_position_embeddings") or getattr(config, "original_max_position_embeddings", None)
            or config.max_position_embeddings)  # (HF's default where the config names none)
