"""The rectangle's model calls (``rectangle.ModelCalls``) as plain forwards over HF's caches, dynamic or static.

``fast/static_reads.CapturedCalls`` replays the same calls captured, and ``fast/store.choose_calls`` decides which
a generate call gets. What differs by family is read off the model here, once: how its layers read the mask
(``read_mask``), where a long-RoPE model reads everything again (``read_start``), what its layers keep
(``layer_kinds``), a read one token at a time where a model cannot continue its cache's state over several
(``cached_forward``). Whether it can take a path at all is its ``Abilities`` (``core/abilities.py``);
docs/model_families.md shows what each family gets on each path.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from transformers.cache_utils import Cache, DynamicCache, DynamicLayer, StaticCache, StaticLayer

from ...compat import LINEAR, cache_is_empty, crop_cache, hold_states, record_past, restore_states
from ..features import HiddenStateCapture, lm_forward, read_features, score
from ..notes import notes, say_for
from .rectangle import Committed


def make_cache(model: torch.nn.Module, implementation: str | None, length: int, rollback: int = 0) -> Cache:
    """A fresh KV cache for one model: ``static_cache`` for ``"static"``, else HF's dynamic cache; where the call may
    cut its caches back by up to ``rollback`` tokens (speculation), keeping what that needs (``compat.record_past``:
    a layer that dropped what fell out of its window, or overwrote its state, could not be cut back past it)."""
    cache = static_cache(model.config, length) if implementation == "static" else DynamicCache(config=model.config)
    if rollback:
        record_past(cache, rollback)
    return cache


class SizedStaticCache(StaticCache):
    """HF's static cache, its attention layers holding more columns than the tokens read, as HF's mask code must know
    to mask them: it asks ``is_compileable``, which a convolution layer recording its past for a rollback (LFM2's,
    speculating) turns false, and then lets a one-token query attend to every column, unwritten ones too (the cut
    back answers differed from the same call without speculation). Its layers are static: R2R compiles none of
    these recording caches (a recurrent layer keeps R2R's calls eager)."""

    @property
    def is_compileable(self) -> bool:
        return True


def static_cache(config, length: int) -> StaticCache:
    """HF's static cache of ``length`` columns, its windowed (and chunked) layers holding every column too: the
    windows live in the masks HF builds from the config, a rollback moves a device length back (a windowed static
    layer rolls its columns and counts on the host: it can neither be cut back past its window nor captured)."""
    cache = SizedStaticCache(config=config, max_cache_len=length)
    for i, layer in enumerate(cache.layers):
        windowed = isinstance(layer, StaticLayer) and getattr(layer, "is_sliding", False)
        if windowed and not isinstance(layer, LINEAR):  # (a hybrid layer keeps its recurrent half: not captured)
            cache.layers[i] = StaticLayer(max_cache_len=length)
            # Still windowed to HF's mask code, which sizes a window's mask from the first layer it finds windowed
            # (or else the first layer: a recurrent one in RecurrentGemma, whose count 5.25 reads as the queries').
            cache.layers[i].is_sliding = True
    return cache


def read_mask(model: torch.nn.Module, cache: Cache, seq: Committed, start: int, end: int) -> torch.Tensor | None:
    """The attention mask of a read of columns ``start:end`` into ``cache``, as the model's layers read it: over
    every column up to ``end``; as wide as a static cache's keys where every layer attends, padded rows or not (a
    model that builds position biases from the mask, BLOOM's and Falcon-RW's ALiBi, needs it that wide: without one
    it sizes them by the tokens read and fails on the static keys; a captured read passes the same); over the read's
    own columns where no layer attends (a state-space model's mixer zeroes its padded inputs: HF passes it the
    prompt's mask, then none)."""
    if isinstance(cache, StaticCache) and layer_kinds(model) == {"attention"}:
        return seq.mask
    return piece_mask(model, seq.mask_upto(end), start, end)


def piece_mask(model: torch.nn.Module, mask: torch.Tensor | None, start: int, end: int) -> torch.Tensor | None:
    """What a read of columns ``start:end`` passes of ``mask`` (every column up to ``end`` at least, or None): all of
    it where a layer attends, the read's own columns where none does."""
    if mask is None or "attention" in layer_kinds(model):
        return mask
    return mask[:, start:end]


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


def cached_forward(model: torch.nn.Module, ids: torch.Tensor, positions: torch.Tensor, cache: Cache | None, keep,
                   mask_at: Callable[[int, int], torch.Tensor | None], stepwise: str | None = None) -> torch.Tensor:
    """``lm_forward`` of ``ids`` [B, T] into ``cache``, its logits at ``keep`` (the last n, 0: all, or the indices of a
    tensor); one forward per token where ``model`` cannot continue its cache's state over several tokens
    (``stepwise``: why, its ``Abilities.continues``) and the cache holds some. ``mask_at(i, j)``: the mask of a read
    of tokens ``i:j``."""
    width = ids.shape[1]
    if width == 1 or cache is None or stepwise is None or cache_is_empty(cache):
        return lm_forward(model, ids, mask_at(0, width), positions, cache, keep)
    say_for(model, f"R2R reads {type(model).__name__} ({model.config.model_type!r}) one token at a time past its "
                   f"prompt: {stepwise}.")
    logits = torch.cat([lm_forward(model, ids[:, i : i + 1], mask_at(i, i + 1), positions[:, i : i + 1], cache)
                        for i in range(width)], 1)
    return logits[:, keep] if isinstance(keep, torch.Tensor) else logits[:, -keep:] if keep else logits


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
        rollback: the most tokens the call may cut its caches back by (speculation: ``make_cache``; 0: none).
        stepwise: per model ("slm", "llm"), why it reads one token at a time past its prompt (``cached_forward``).
    """

    def __init__(self, slm, llm, router, num_topk: int, cache_implementation: str | None, capacity: int,
                 caches: tuple[Cache, Cache] | None = None, rollback: int = 0,
                 stepwise: dict[str, str | None] | None = None) -> None:
        self.slm, self.llm, self.router, self.num_topk, self.capacity = slm, llm, router, num_topk, capacity
        self.rollback, self.lent = int(rollback), caches is not None
        if caches is None:
            caches = tuple(make_cache(m, cache_implementation, capacity, self.rollback) for m in (slm, llm))
        elif self.rollback:  # (a captured engine's caches, lent to this call: they record its past while it lasts)
            for cache in caches:
                record_past(cache, self.rollback)
        self.slm_cache, self.llm_cache = caches
        self.stepwise = stepwise or {}
        self.held: dict[str, list] = {}  # each model's checkpoint of its recurrent states (``keep``)

    def _read(self, model, cache: Cache, seq: Committed, start: int, end: int, keep) -> torch.Tensor:
        """``model`` reads columns ``start:end`` into ``cache``; its logits at ``keep`` (``cached_forward``)."""
        role = "slm" if model is self.slm and cache is self.slm_cache else "llm"
        return cached_forward(model, seq.ids[:, start:end], seq.positions[:, start:end], cache, keep,
                              lambda i, j: read_mask(model, cache, seq, start + i, start + j), self.stepwise.get(role))

    def slm_read(self, seq: Committed, start: int) -> tuple[torch.Tensor, torch.Tensor]:
        end = seq.length
        start = read_start(self.slm, self.slm_cache, start, end)
        with HiddenStateCapture(self.slm) as capture:
            logits = self._read(self.slm, self.slm_cache, seq, start, end, 1)
            return logits[:, -1], capture.hidden[:, -1]

    def route_scores(self, logits: torch.Tensor, hidden: torch.Tensor, token: torch.Tensor) -> torch.Tensor:
        return route_scores(self.slm, self.router, self.num_topk, logits, hidden, token)

    def llm_read(self, seq: Committed, start: int) -> torch.Tensor:
        end = seq.length
        start = read_start(self.llm, self.llm_cache, start, end)
        return self._read(self.llm, self.llm_cache, seq, start, end, 1)[:, -1]

    def llm_predict(self, seq: Committed, start: int, end: int, keep: list[int]) -> torch.Tensor:
        """The LLM reads columns ``start:end``; its logits [B, n, V] after each column of ``keep`` (computed there
        only: HF's ``logits_to_keep`` takes the positions)."""
        start = read_start(self.llm, self.llm_cache, start, end)
        at = torch.tensor([c - start for c in keep], device=seq.ids.device)
        return self._read(self.llm, self.llm_cache, seq, start, end, at)

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
