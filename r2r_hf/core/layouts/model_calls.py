"""The rectangle's model calls (``rectangle.ModelCalls``) as plain forwards over HF's caches, dynamic or static.

``fast/static_reads.CapturedCalls`` replays the same calls captured, and ``fast/store.choose_calls`` decides which
a generate call gets. What differs by family is read off the model here, once: how its layers read the mask
(``read_mask``), where a long-RoPE model reads everything again (``read_start``), whether its cache can be cut back
for speculation (``rollback_problem``). docs/model_families.md shows what each family gets on each path.
"""

from __future__ import annotations

import torch
from transformers import cache_utils
from transformers.cache_utils import Cache, DynamicCache, DynamicLayer, StaticCache, StaticLayer

from ...compat import cache_argument, crop_cache
from ..features import HiddenStateCapture, input_device, lm_forward, read_features, score
from ..notes import notes
from .rectangle import Committed

# HF's recurrent and convolution cache layers (5.17 may lack the class: then every layer attends)
LINEAR = getattr(cache_utils, "LinearAttentionCacheLayerMixin", ())


def make_cache(model: torch.nn.Module, implementation: str | None, length: int, rollback: bool = False) -> Cache:
    """A fresh KV cache for one model: ``static_cache`` for ``"static"``, else HF's dynamic cache; where the call may
    ``rollback`` (speculation cuts the caches back), ``keeping_past``: a layer that dropped what fell out of its
    window could not be cut back past it."""
    cache = static_cache(model.config, length) if implementation == "static" else DynamicCache(config=model.config)
    return keeping_past(cache) if rollback else cache


def keeping_past(cache: Cache) -> Cache:
    """``cache``, its windowed and convolution layers keeping what they would drop until a cut (``crop``) tells them
    how far back to keep it (HF's own rollback mode for assisted decoding)."""
    for layer in cache.layers:
        if hasattr(layer, "activate_past_recording"):
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
            # Still windowed to HF's mask code, which sizes a window's mask from the first layer it finds windowed
            # (or else the first layer: a recurrent one in RecurrentGemma, whose count 5.25 reads as the queries').
            cache.layers[i].is_sliding = True
    return cache


def static_shape_problem(model: torch.nn.Module) -> str | None:
    """Why a static cache allocated up front from ``model``'s config (as the captured path allocates it) would not fit
    its attention's keys (Falcon's multi-query attention keeps one key head where its config counts every head), or
    None; read once per model from one forward over a cache that sizes itself."""
    known = notes(model)
    if "static_shape_problem" not in known:
        known["static_shape_problem"] = None
        declared = model._get_static_cache_init_shape()  # private HF hook (tests/test_hf_internals.py guards it)
        if declared is not None:
            cache = static_cache(model.config, 2)
            with torch.inference_mode():
                model(input_ids=torch.zeros(1, 1, dtype=torch.long, device=input_device(model)), use_cache=True,
                      **cache_argument(cache))
            for i, layer in enumerate(cache.layers):
                heads, dim = (value[i] if isinstance(value, (list, tuple)) else value for value in declared)
                if layer.is_initialized and tuple(layer.keys.shape[1::2]) != (heads, dim):
                    known["static_shape_problem"] = (
                        f"its attention keeps {layer.keys.shape[1]} key heads of {layer.keys.shape[-1]} where its "
                        f"config declares {heads} of {dim} (multi-query attention), so a static cache cannot be "
                        "allocated for it before the capture")
                    break
    return known["static_shape_problem"]


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

    def crop(self, slm_tokens: int, llm_tokens: int) -> None:
        """Each model's cache drops its last tokens (a rollback)."""
        crop_cache(self.slm_cache, slm_tokens)
        crop_cache(self.llm_cache, llm_tokens)

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


def rollback_problem(model: torch.nn.Module) -> str | None:
    """Why a rollback (speculation) cannot cut ``model``'s cache back exactly, or None where it can.

    Checked once per model on its own weights: 4 tokens read, then 2 more, cut back by 2 and 2 others read; the
    logits must be those of one plain forward over the 6 tokens kept, and no layer may hold a recurrent state.
    """
    known = notes(model)
    if "rollback_problem" not in known:
        known["rollback_problem"] = _rollback_probe(model) if long_rope_switch(model) is None else (
            "its long-context rotary factors follow the sequence's length, so a cut back across its original context "
            "would keep keys read with the other factors")
    return known["rollback_problem"]


def _rollback_probe(model: torch.nn.Module) -> str | None:
    device = input_device(model)
    ids = (torch.arange(8, device=device)[None] * 37 + 3) % model.get_input_embeddings().weight.shape[0]
    positions = torch.arange(6, device=device)[None]
    cache = make_cache(model, None, 8, rollback=True)
    with torch.inference_mode():
        try:
            lm_forward(model, ids[:, :4], None, positions[:, :4], cache)
            lm_forward(model, ids[:, 4:6], None, positions[:, 4:6], cache)
            crop_cache(cache, 2)
            got = lm_forward(model, ids[:, 6:], None, positions[:, 4:6], cache)[0, -1].float()
        except Exception as err:  # noqa: BLE001 - any failure means: it cannot be cut back
            return f"its cache cannot be cut back to an earlier token (transformers raises {type(err).__name__})"
        want = lm_forward(model, torch.cat([ids[:, :4], ids[:, 6:]], 1), None, positions, None)[0, -1].float()
    if any(any(getattr(layer, "is_recurrent_states_initialized", {}).values()) for layer in cache.layers):
        return "its recurrent (state-space) layers keep a state that cannot be cut back to an earlier token"
    tolerance = 1e-3 if model.dtype == torch.float32 else 5e-2
    if not bool((got - want).abs().max() <= tolerance * want.abs().max().clamp(min=1e-6)):
        return "its state does not follow its cache when the cache is cut back (a state kept on its modules)"
    return None
