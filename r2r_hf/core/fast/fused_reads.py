"""Fused reads over the two caches, and the regions a model's reads run.

``static_read`` has the signature of ``static_reads.read_fn`` (generate's reads over HF's ``StaticCache``) and
``slot_read`` that of ``slot_reads.PaddedSteps._fn`` (the server's reads over slots): the capture code
chooses one or the other and captures it the same way. Both leave the caches exactly as HF's forward would
(keys and values at the same columns, the static layers' lengths), so an eager read over the same cache can
follow a fused one. The regions are ``fused.py``'s.
"""

from __future__ import annotations

import logging
import types
from collections.abc import Callable

import torch
from transformers.cache_utils import StaticCache

from . import fused
from ..notes import notes
from .graphs import Step, recompile_limit
from ..layouts.slot_cache import SlotCache

logger = logging.getLogger(__name__)


class Regions:
    """The region functions of one model, compiled (``REGION_OPTIONS``) or plain (the self-check, counting ops).

    Compiled regions are fresh copies of the functions per model: dynamo keeps its compiled entries (and its
    recompile limit) per code object, and one model meets up to four shapes per region (1 or more rows x 1
    or more tokens: dynamic shapes still specialise sizes 0 and 1), so two models would share one limit.
    """

    def __init__(self, compile: bool) -> None:
        names = ("static_prologue", "slot_prologue", "static_layer", "slot_layer", "head", "packed_prologue",
                 "packed_layer", "packed_head")
        # The functions dynamo compiles (fresh code objects when compiled: their compiled entries are this model's).
        self.functions = {name: _fresh(getattr(fused, name)) if compile else getattr(fused, name) for name in names}
        self.compiled = compile
        for name, fn in self.functions.items():
            setattr(self, name, _region(torch.compile(fn, **fused.REGION_OPTIONS)) if compile else fn)


# How a compiled region is called: None runs it; the CPU emulation of CUDA graphs sets its own
# (``testing/graphs.py``: a compiled region cannot run under the emulation's dispatch modes).
region_runner = None


def _region(compiled):
    def call(*args):
        return compiled(*args) if region_runner is None else region_runner(compiled, args)

    call.__name__ = getattr(compiled, "__name__", "region")
    return call


def _fresh(fn):
    """``fn`` with its own code object (so its compiled entries are its own)."""
    return types.FunctionType(fn.__code__.replace(), fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__)


PLAIN = Regions(compile=False)


def regions_for(model: torch.nn.Module, fuse: bool | str, why_not: str | None) -> Regions | None:
    """The fused regions a model's captured reads run (None: HF's forward): compiled with ``fuse``, plain (uncompiled,
    for tests on emulated graphs) with ``fuse="plain"``, none without, nor where the model cannot be fused (``why_not``:
    its ``Abilities.fuse``, said once per model where fusing was asked)."""
    if not fuse:
        return None
    if why_not is not None:
        if fuse is True and not notes(model).get("fuse_logged"):
            notes(model)["fuse_logged"] = True
            logger.warning("R2R captures %s's HF forward, unfused: %s.", type(model).__name__, why_not)
        return None
    return PLAIN if fuse == "plain" else compiled_regions(model)


def compiled_regions(model: torch.nn.Module) -> Regions:
    """``model``'s compiled regions (made on first use, kept in the core's notes on it)."""
    known = notes(model)
    if "fused_regions" not in known:
        known["fused_regions"] = Regions(compile=True)
    return known["fused_regions"]


# Compiles one region of one model may take: 4 shape classes (1 or more rows x 1 or more tokens: sizes 1
# specialise) x the reads that call it (static and slot; with and without the hidden state, the last position or
# all). Dynamo's default (8) was hit on the H200 by the SLM's head in a process that ran `generate` and served.
REGION_COMPILES = 32


def capture_fused(capture, read: Callable[[], Step], example: dict, who: str) -> Step | None:
    """``capture(read(), example)``: a fused read captured, or None after any failure (a compiler's), said once
    per model by the caller turning fusing off; the caller then captures HF's forward instead."""
    try:
        with recompile_limit(REGION_COMPILES):
            return capture(read(), example)
    except Exception as err:  # noqa: BLE001 - whatever inductor raises: capture HF's forward instead
        logger.warning("R2R captures %s's HF forward: its fused read did not compile (%s: %s).", who,
                       type(err).__name__, (str(err).splitlines() or [""])[0])
        return None


def _dynamic(*marks: tuple) -> None:
    """Mark the rows, tokens and cache-length dims of the regions' inputs dynamic (``(tensor, *dims)`` each), so the
    first compile of a region serves every batch size and bucket (and cache capacity, where a read attends fewer
    columns than the cache holds: one attending all of it specialises on its length); without the marks a region
    compiles static first, then again dynamic on the next shape. Sizes 1 still specialise (dynamo's rule): one row
    x one token, one row x a piece, several rows x one token and x a piece compile apart (four per region)."""
    for tensor, *dims in marks:
        for dim in dims:
            torch._dynamo.maybe_mark_dynamic(tensor, dim)


def _groups(model: torch.nn.Module) -> int:
    config = model.config
    return config.num_attention_heads // config.num_key_value_heads


def static_read(model: torch.nn.Module, cache: StaticCache, hidden: bool, span: int, regions: Regions,
                every: bool = False) -> Step:
    """``static_reads.read_fn`` fused: (ids, positions [B, b], mask [B, L], last [1], rewind []) -> logits [B, V]
    (, hidden); with ``every``, ``last`` [n] lists the positions whose logits [B, n, V] are kept (a resolution's).

    New tokens go to the columns after the cache's length, every row at the same ones (HF's rectangle); the
    read attends the first ``span`` columns; the cache's lengths advance by the piece less ``rewind``.
    """
    layers, groups = cache.layers, _groups(model)
    lengths = [layer.cumulative_length for layer in layers]
    weights = [fused.layer_weights(layer) for layer in model.model.layers]

    def read(ids, positions, mask, last, rewind):
        _dynamic((ids, 0, 1), (positions, 0, 1), (mask, 0, 1), *(((last, 0),) if every else ()))
        x, cos, sin, packed, column = regions.static_prologue(model, ids, positions, mask, lengths[0], groups, span)
        _dynamic((x, 0, 1), (cos, 0, 1), (sin, 0, 1), (packed, 0, 2), (column, 0))
        for layer, kv, w in zip(model.model.layers, layers, weights):
            _dynamic((kv.keys, 0, 2), (kv.values, 0, 2))
            x = regions.static_layer(layer, x, cos, sin, packed, kv.keys, kv.values, column, w, span)
            _dynamic((x, 0, 1))
        torch._foreach_add_(lengths, [ids.shape[1] - rewind] * len(lengths))  # one kernel (the scalar form syncs)
        return fused.kept_head(model, x, last) if every else regions.head(model, x, last, hidden)

    return read


def slot_read(model: torch.nn.Module, cache: SlotCache, hidden: bool, regions: Regions,
              span: int | None = None) -> Step:
    """``slot_cache.forward_piece`` fused: (ids, position, column, real [k, g], and ``slots`` [k] where the read
    gathers its rows; else the first k slots) -> outputs.

    Padding is written to the spare column and its queries see column 0 (``slot_cache.piece_masks``); the read
    attends the first ``span`` columns (default: the slots' whole capacity; captured reads have fixed shapes).
    """
    groups, span = _groups(model), cache.capacity if span is None else span
    weights = [fused.layer_weights(layer) for layer in model.model.layers]
    allocate(model, cache)

    def read(ids, position, column, real, slots=None):
        _dynamic((ids, 0, 1), (position, 0, 1), (real, 0, 1), *(() if slots is None else ((slots, 0),)))
        x, cos, sin, packed = regions.slot_prologue(model, ids, position, real, groups, span)
        _dynamic((x, 0, 1), (cos, 0, 1), (sin, 0, 1), (packed, 0, 2), (column, 0, 1))
        for i, (layer, w) in enumerate(zip(model.model.layers, weights)):
            x = regions.slot_layer(layer, x, cos, sin, packed, cache.keys[i], cache.values[i], column, w, span, slots)
            _dynamic((x, 0, 1))
        return regions.head(model, x, None, hidden)

    return read


def allocate(model: torch.nn.Module, cache: SlotCache) -> None:
    """Allocate the slot buffers HF's first write would (a fused read writes into them directly)."""
    config = model.config
    dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    weight = model.get_input_embeddings().weight
    for store in (cache.keys, cache.values):
        for i, buffer in enumerate(store):
            if buffer is None:
                store[i] = weight.new_zeros(cache.slots, config.num_key_value_heads, cache.capacity + 1, dim)


