"""Fused reads over the two caches, and when a model's reads may be fused.

``static_read`` has the signature of ``static_reads.read_fn`` (generate's reads over HF's ``StaticCache``) and
``slot_read`` that of ``slot_reads.CapturedReads._fn`` (the server's reads over slots): the capture code
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
from ..layouts.slot_cache import SlotCache, continuation_problem, piece_inputs, slot_problem

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


def fused_regions(model: torch.nn.Module) -> Regions | None:
    """``model``'s compiled regions (made on first use, kept in the core's notes on it), or None where it cannot be
    fused (the reason is logged once per model)."""
    problem = fuse_problem(model)
    if problem is not None:
        if not notes(model).get("fuse_logged"):
            notes(model)["fuse_logged"] = True
            logger.warning("R2R captures %s's HF forward, unfused: %s.", type(model).__name__, problem)
        return None
    return compiled_regions(model)


def regions_for(model: torch.nn.Module, fuse: bool | str) -> Regions | None:
    """The fused regions a model's captured reads run (None: HF's forward): compiled with ``fuse``, plain (uncompiled,
    for tests on emulated graphs) with ``fuse="plain"``, none without."""
    if fuse == "plain":
        return PLAIN if fuse_problem(model) is None else None
    return fused_regions(model) if fuse else None


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


# ------------------------------------------------------------------ the guard
def fuse_problem(model: torch.nn.Module) -> str | None:
    """Why ``model``'s reads cannot be fused, or None when they can (checked once per model).

    The structure is checked by name; then the fused read (uncompiled) of a short sequence in two slots is
    compared with the model's own forward, so a variant that computes otherwise is caught.
    """
    known = notes(model)
    if "fuse_problem" not in known:
        problem = _structure_problem(model)
        known["fuse_problem"] = problem if problem is not None else _self_check(model)
    return known["fuse_problem"]


def _structure_problem(model: torch.nn.Module) -> str | None:
    config = model.config
    if config.model_type not in fused.FUSABLE:
        return f"its architecture {config.model_type!r} is not one fused here ({', '.join(fused.FUSABLE)})"
    if not hasattr(torch.nn.functional, "scaled_dot_product_attention") or not torch._dynamo.is_dynamo_supported():
        return "this torch cannot compile (torch.compile is not supported here)"
    if any(kind != "full_attention" for kind in getattr(config, "layer_types", None) or ()):
        return "it has sliding-window layers"
    if config.model_type == "mistral" and getattr(config, "sliding_window", None):
        return "its attention slides over a window"
    inner = getattr(model, "model", None)
    needed = ("embed_tokens", "rotary_emb", "layers", "norm")
    if inner is None or not all(hasattr(inner, name) for name in needed) or not hasattr(model, "lm_head"):
        return "its modules are not named as HF's decoders name them"
    for layer in inner.layers:
        attn = getattr(layer, "self_attn", None)
        if attn is None or not all(hasattr(attn, n) for n in ("q_proj", "k_proj", "v_proj", "o_proj", "scaling")):
            return "its attention is not HF's q/k/v/o projections"
        if not all(hasattr(layer, n) for n in ("input_layernorm", "post_attention_layernorm", "mlp")):
            return "its decoder layer is not norm-attention-norm-MLP"
        mlp = layer.mlp
        if not all(hasattr(mlp, n) for n in ("gate_proj", "up_proj", "down_proj", "act_fn")):
            return "its MLP is not HF's gated gate/up/down projections"
        if not (fused.packable([attn.q_proj, attn.k_proj, attn.v_proj]) and fused.packable([mlp.gate_proj,
                                                                                             mlp.up_proj])):
            return "its projections are not plain nn.Linear layers on one device (quantised, offloaded or hooked)"
    return None


def _self_check(model: torch.nn.Module, measured: dict | None = None) -> str | None:
    """The fused read against the plain forward, allowed twice what HF's own read in slots departs by (rounding: a
    deep model in bf16 departs far more than a tiny one; the random 32B's fused read was 6 % off on an H200, over
    the 5 % bf16 tolerance, while its captured HF reads departed 8 % from eager ones); a wrong structure is off by
    the logits' whole scale."""
    own = notes(model).get("slot_read_max_rel") if slot_problem(model) is None else None  # (measured there once)
    found = {} if measured is None else measured
    problem = continuation_problem(model, lambda cache, tokens: _fused_piece(model, cache, tokens, start=4, count=3),
                                   "its fused forward failed", "its fused logits differ from its own forward", found,
                                   rounding=own or 0.0)
    found["slot_read_max_rel"] = own
    return problem


def self_check(model: torch.nn.Module) -> dict:
    """The fused self-check run again, with what it measured: ``problem`` (None: fused), and where it compared,
    ``max_rel`` (the largest logit difference over the largest logit) and ``tolerance`` (for the device check)."""
    measured: dict = {}
    problem = _structure_problem(model)
    if problem is None:
        problem = _self_check(model, measured)
    return {"problem": problem, **measured}


def _fused_piece(model, cache: SlotCache, tokens: torch.Tensor, start: int, count: int) -> torch.Tensor:
    """Slot 1's logits after reading ``count`` more tokens through the plain fused regions (slot 0 idle)."""
    inputs = piece_inputs(tokens, [0, 1], [0, start], [0, count], count, cache.trash)
    read = slot_read(model, cache, hidden=False, regions=PLAIN)
    return read(**inputs)[0][1]
