"""The rectangle's model calls (``rectangle.ModelCalls``) as plain forwards over HF's caches, dynamic or static.

``fast/static_reads.CapturedCalls`` replays the same calls captured, and ``fast/store.choose_calls`` decides which
a generate call gets. What differs by family is read off the model here, once: how its layers read the mask
(``read_mask``), where a long-RoPE model reads everything again (``read_start``), whether a read of several tokens
continues what its cache holds (``continuation_problem``), whether its cache can be cut back for speculation
(``rollback_problem``). docs/model_families.md shows what each family gets on each path.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from transformers.cache_utils import Cache, DynamicCache, DynamicLayer, StaticCache, StaticLayer

from ...compat import LINEAR, RECURRENT_HISTORY, bound_past, cache_argument, cache_is_empty, crop_cache, layer_written
from ...compat import record_past, stop_recording
from ..features import HiddenStateCapture, input_device, lm_forward, read_features, score
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


def static_shape_problem(model: torch.nn.Module) -> str | None:
    """Why a static cache allocated up front from ``model``'s config (as the captured path allocates it) would not fit
    its attention's keys (Falcon's multi-query attention keeps one key head where its config counts every head), or
    None; read once per model from one forward over a cache that sizes itself."""
    known = notes(model)
    if "static_shape_problem" not in known:
        known["static_shape_problem"] = None
        try:
            declared = model._get_static_cache_init_shape()  # private HF hook (tests/test_hf_internals.py guards it)
        except Exception as err:  # noqa: BLE001 - (5.17 reads a per-layer head_dim of Gemma 4 as one)
            known["static_shape_problem"] = (f"transformers cannot size its static cache before a forward (it raises "
                                             f"{type(err).__name__})")
            return known["static_shape_problem"]
        if declared is not None:
            cache = static_cache(model.config, 2)
            with torch.inference_mode():
                model(input_ids=torch.zeros(1, 1, dtype=torch.long, device=input_device(model)), use_cache=True,
                      **cache_argument(cache, model))
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
                   mask_at: Callable[[int, int], torch.Tensor | None]) -> torch.Tensor:
    """``lm_forward`` of ``ids`` [B, T] into ``cache``, its logits at ``keep`` (the last n, 0: all, or the indices of a
    tensor); one forward per token where ``model`` cannot continue its cache's state over several tokens
    (``continuation_problem``) and the cache holds some. ``mask_at(i, j)``: the mask of a read of tokens ``i:j``."""
    width = ids.shape[1]
    if width == 1 or cache is None or continuation_problem(model) is None or cache_is_empty(cache):
        return lm_forward(model, ids, mask_at(0, width), positions, cache, keep)
    say_for(model, f"R2R reads {type(model).__name__} ({model.config.model_type!r}) one token at a time past its "
                   f"prompt: {continuation_problem(model)}.")
    logits = torch.cat([lm_forward(model, ids[:, i : i + 1], mask_at(i, i + 1), positions[:, i : i + 1], cache)
                        for i in range(width)], 1)
    return logits[:, keep] if isinstance(keep, torch.Tensor) else logits[:, -keep:] if keep else logits


def continuation_problem(model: torch.nn.Module) -> str | None:
    """Why a read of several tokens into a cache that holds earlier ones would not give ``model``'s logits, or None.

    transformers' Mamba and FalconMamba scans start a read of several tokens from a zero state, and RecurrentGemma's
    convolution from zero inputs, whatever the cache holds (one token at a time, and a first read, are right). Checked
    once per model on its own weights, whatever its cache's layers say (5.17's RecurrentGemma cache shows attention
    layers only): 3 tokens, then 5, against one forward over the 8.
    """
    known = notes(model)
    if "continuation_problem" not in known:
        device = input_device(model)
        ids = (torch.arange(8, device=device)[None] * 37 + 3) % model.get_input_embeddings().weight.shape[0]
        positions, cache = torch.arange(8, device=device)[None], DynamicCache(config=model.config)
        with torch.inference_mode():
            lm_forward(model, ids[:, :3], None, positions[:, :3], cache)
            got = lm_forward(model, ids[:, 3:], None, positions[:, 3:], cache, 0)[0].float()
            want = lm_forward(model, ids, None, positions, None, 0)[0, 3:].float()
        # (a read in pieces sums as one forward does, to fp32 rounding)
        known["continuation_problem"] = None if close(got, want, model, 2e-5) else (
            "its forward over several tokens does not continue the state its cache holds (transformers computes part "
            "of such a read as if no token came before it)")
    return known["continuation_problem"]


def close(got: torch.Tensor, want: torch.Tensor, model: torch.nn.Module, fp32: float = 1e-3) -> bool:
    """Two reads' logits agree within ``fp32`` in float32, bf16's rounding else (relative to the largest logit)."""
    tolerance = fp32 if model.dtype == torch.float32 else 5e-2
    return bool((got - want).abs().max() <= tolerance * want.abs().max().clamp(min=1e-6))


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
    """

    def __init__(self, slm, llm, router, num_topk: int, cache_implementation: str | None, capacity: int,
                 caches: tuple[Cache, Cache] | None = None, rollback: int = 0) -> None:
        self.slm, self.llm, self.router, self.num_topk, self.capacity = slm, llm, router, num_topk, capacity
        self.rollback, self.lent = int(rollback), caches is not None
        if caches is None:
            caches = tuple(make_cache(m, cache_implementation, capacity, self.rollback) for m in (slm, llm))
        elif self.rollback:  # (a captured engine's caches, lent to this call: they record its past while it lasts)
            for cache in caches:
                record_past(cache, self.rollback)
        self.slm_cache, self.llm_cache = caches

    def _read(self, model, cache: Cache, seq: Committed, start: int, end: int, keep) -> torch.Tensor:
        """``model`` reads columns ``start:end`` into ``cache``; its logits at ``keep`` (``cached_forward``)."""
        logits = cached_forward(model, seq.ids[:, start:end], seq.positions[:, start:end], cache, keep,
                                lambda i, j: read_mask(model, cache, seq, start + i, start + j))
        if self.rollback:
            bound_past(cache, self.rollback)
        return logits

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

    def crop(self, slm_tokens: int, llm_tokens: int) -> None:
        """Each model's cache drops its last tokens (a rollback)."""
        crop_cache(self.slm_cache, slm_tokens)
        crop_cache(self.llm_cache, llm_tokens)

    def close(self) -> None:
        if self.lent and self.rollback:
            for cache in (self.slm_cache, self.llm_cache):
                stop_recording(cache)


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
    cache = make_cache(model, None, 8, rollback=2)
    def read(piece: slice, at: slice) -> torch.Tensor:  # (as R2R reads: one token at a time where it must)
        return cached_forward(model, ids[:, piece], positions[:, at], cache, 1, lambda i, j: None)[0, -1].float()

    with torch.inference_mode():
        try:
            read(slice(0, 4), slice(0, 4))
            read(slice(4, 6), slice(4, 6))
            if any(layer_written(layer) is False for layer in cache.layers):  # (a layer its forward never wrote)
                return "it keeps its recurrent state on its modules, not in its cache, so a cut back cannot reach it"
            recurrent = any(any(getattr(layer, "is_recurrent_states_initialized", {}).values())
                            for layer in cache.layers)
            if recurrent and not RECURRENT_HISTORY:
                return ("its recurrent (state-space) layers keep a state that this transformers release cannot cut "
                        "back to an earlier token (5.25 can)")
            crop_cache(cache, 2)
            got = read(slice(6, 8), slice(4, 6))
        except Exception as err:  # noqa: BLE001 - any failure means: it cannot be cut back
            return f"its cache cannot be cut back to an earlier token (transformers raises {type(err).__name__})"
        want = lm_forward(model, torch.cat([ids[:, :4], ids[:, 6:]], 1), None, positions, None)[0, -1].float()
    if not close(got, want, model):
        if recurrent:
            return ("transformers' cut back of its recurrent (state-space) state does not restore the state of the "
                    "earlier token")
        return "its state does not follow its cache when the cache is cut back (a state kept on its modules)"
    return None
