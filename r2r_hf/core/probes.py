"""The checks behind a model's abilities (``abilities.py``): each reads the model's config and structure, then runs it
on a few tokens of its own weights where only running it can tell. Each returns why the model cannot (a clause about
the model: "its attention is ..."), or None. Called once per model, by ``abilities.abilities`` only.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from transformers.cache_utils import StaticLayer

from ..compat import cache_argument, crop_cache, hold_states, layer_written, restore_states
from .features import input_device, lm_forward, output_device
from .fast import fused
from .fast.fused_reads import PLAIN, slot_read
from .fast.graphs import host_work
from .layouts.model_calls import cached_forward, layer_kinds, long_rope_switch, make_cache, static_cache
from .layouts.slot_cache import SlotCache, piece_inputs, read_piece

# Attention that takes R2R's prepared 4-D masks (slots; a captured read builds its mask from device tensors). Flash
# attention syncs the host (``.all()``, ``nonzero``) and, given an all-ones mask, would attend empty columns.
MASKED_ATTENTION = ("sdpa", "eager")


def _attention(model: torch.nn.Module) -> str:
    return getattr(model.config, "_attn_implementation", None) or "eager"


# ------------------------------------------------------------------ slots
def slot_problem(model: torch.nn.Module, measured: dict, stepwise: str | None = None) -> str | None:
    """Why ``model`` cannot decode in slots: its attention path, long-RoPE factors, or a short sequence read in two
    slots and in pieces — with a rollback on the way: two other tokens read, then cut back (a recurrent state back to
    its checkpoint) — that does not give one plain forward's logits (an architecture that ignores a prepared mask,
    the cache, or keeps a state outside it). ``measured["slot_read_max_rel"]``: that read's gap (the fused check's
    yardstick). A model that reads one token at a time past its prompt (``stepwise``: ``continues_problem``) is read
    so here too."""
    attention = _attention(model)
    if attention not in MASKED_ATTENTION:
        return f"its attention is {attention!r} (slots need {' or '.join(MASKED_ATTENTION)} attention)"
    if long_rope_switch(model) is not None:
        return "its long-context rotary factors follow the longest row of a forward (one row's answer would depend " \
               "on the others')"
    found: dict = {}

    def read(cache: SlotCache, tokens: torch.Tensor, start: int, count: int) -> torch.Tensor:
        steps = [(start + i, 1) for i in range(count)] if stepwise else [(start, count)]
        return [read_piece(model, cache, tokens, [1], [s], [n])[0] for s, n in steps][-1]

    def rest(cache: SlotCache, tokens: torch.Tensor) -> torch.Tensor:
        other = tokens.clone()
        other[1, 4:6] = tokens[0, :2]
        cache.states.keep([1])  # (``slot_state.py``: what a speculative rollback does)
        read(cache, other, 4, 2)
        cache.states.restore(1)
        return read(cache, tokens, 4, 3)

    problem = slot_read_problem(
        model, rest, "its forward does not accept a per-row cache and mask",
        "its logits read in slots differ from a plain forward (the architecture ignores the prepared mask, or keeps a "
        "state outside its cache)", found)
    measured["slot_read_max_rel"] = found.get("max_rel")
    return problem


def slot_read_problem(model: torch.nn.Module, rest: Callable, failed: str, differs: str,
                         measured: dict | None = None, rounding: float = 0.0) -> str | None:
    """Whether slots read as one plain forward: a 7-token sequence's first 4 tokens are read in slot 1 by HF's
    forward (beside 3 other tokens in slot 0, padded; 4 for a model with recurrent layers, whose rows are never
    padded), then ``rest(cache, tokens)`` reads its last 3 and gives slot 1's logits; None when they match the plain forward's, else ``failed`` (with the error) or ``differs``.
    ``measured`` (when given) receives the largest difference relative to the largest logit, and the tolerance:
    the dtype's, or twice ``rounding`` where that is larger (what another exact way of reading departs by)."""
    device = model.get_input_embeddings().weight.device
    vocab = model.get_input_embeddings().weight.shape[0]
    ids = torch.arange(7, device=device)[None] * 37 % vocab
    with torch.inference_mode():
        want = model(input_ids=ids, use_cache=False).logits[0, -1].float()
        tokens = torch.stack([ids[0].flip(0), ids[0]])  # slot 0 holds other tokens, read beside slot 1
        cache = SlotCache(model.config.num_hidden_layers, 2, 8)
        try:
            read_piece(model, cache, tokens, [0, 1], [0, 0], [4 if "recurrent" in layer_kinds(model) else 3, 4])
            got = rest(cache, tokens).float()
        except Exception as err:  # noqa: BLE001 - any failure means: not this way
            return f"{failed} ({type(err).__name__}: {err})"
    scale = want.abs().max().clamp(min=1e-6)
    tolerance = max(1e-3 if model.dtype == torch.float32 else 5e-2, 2 * rounding)
    gap = (got - want).abs().max() / scale
    if measured is not None:  # the device check writes it down (a pass says nothing of the margin)
        measured.update(max_rel=float(gap), tolerance=tolerance)
    if not bool(gap <= tolerance):
        return differs
    return None


# ------------------------------------------------------------------ capture
def capture_problem(model: torch.nn.Module) -> str | None:
    """Why ``model``'s reads cannot be captured with fixed shapes (the server's slots: ``fast/slot_reads.py``): capture
    needs one device, dense weights, attention that builds its mask from device tensors, rotary embeddings that do
    not change with the sequence length, and keys shaped as its config declares (``static_shape_problem``: Falcon's
    multi-query attention), and a forward that does no host work inside a step (``host_work_problem``: Falcon's new
    architecture)."""
    if len(set(getattr(model, "hf_device_map", {}).values())) > 1:
        return "it is spread over several devices"
    if getattr(model, "hf_quantizer", None) is not None:
        return "it is quantised"
    if input_device(model) != output_device(model):
        return "its input and output layers are on different devices"
    attention = _attention(model)
    if attention not in MASKED_ATTENTION:
        return f"its attention is {attention!r} (only {' and '.join(MASKED_ATTENTION)} attention can be captured)"
    rope = rope_type(model.config)
    if "dynamic" in rope or rope == "longrope":  # HF recomputes these frequencies from the length, on the host
        return f"its rotary embedding ({rope!r}) changes with the sequence length"
    if getattr(model.config, "altup_num_inputs", None):  # (Gemma 3n: its recorded hidden states are the layers' own)
        return "its decoder layers hand on a stack of hidden states (AltUp), not the one the router reads, which the " \
               "captured read does not take"
    # Host work inside the forward is probed over HF's static cache where it holds attention alone (for a hybrid it
    # is not the cache a captured slot step reads: the hybrid tests replay those steps under the graph emulation,
    # which raises on host work).
    attention_only = all(type(layer) is StaticLayer for layer in static_cache(model.config, 1).layers)
    return static_shape_problem(model) or (host_work_problem(model) if attention_only else None)


def static_problem(model: torch.nn.Module) -> str | None:
    """Why ``model``'s reads cannot be captured over HF's static cache (``generate``'s captured path:
    ``fast/static_reads.py``): its layers must all be attention, keeping their length in a device tensor (R2R's static
    caches hold every column of a windowed layer too: ``model_calls.static_cache``), sized as the config declares.
    Asked after ``capture_problem`` (``abilities``), which has probed such a model's forward for host work."""
    others = {type(layer).__name__ for layer in static_cache(model.config, 1).layers if type(layer) is not StaticLayer}
    if others:
        return f"its static cache has layers other than attention: {_kinds(others)}"
    return None


def _kinds(names: set[str]) -> str:
    """What a static cache's non-attention layers are, in words (``DummyLayer``: a layer that reads another
    layer's keys and values — Gemma 3n's and Gemma 4's KV-shared layers; a linear-attention layer: a recurrent
    state)."""
    said = []
    if any("LinearAttention" in n for n in names):
        said.append("recurrent (state-space, linear-attention or convolution) layers, which generate's captured "
                    "pieces would advance over their padding (the server's captured slots read them unpadded)")
    if "DummyLayer" in names:
        said.append("placeholders for layers that reuse another layer's keys and values (KV sharing)")
    rest = sorted(n for n in names if "LinearAttention" not in n and n != "DummyLayer")
    return "; ".join(said + ([f"{', '.join(rest)}"] if rest else []))


def rope_type(config) -> str:
    """The config's RoPE type ("default" when it names none)."""
    rope = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    if isinstance(rope, dict) and isinstance(next(iter(rope.values()), None), dict):  # per layer type
        return ",".join(sorted({str(r.get("rope_type", r.get("type", "default"))) for r in rope.values()}))
    return str(rope.get("rope_type", rope.get("type", "default"))) if isinstance(rope, dict) else "default"


def static_shape_problem(model: torch.nn.Module) -> str | None:
    """Why a static cache allocated up front from ``model``'s config (as the captured path allocates it) would not fit
    its attention's keys (Falcon's multi-query attention keeps one key head where its config counts every head), read
    from one forward over a cache that sizes itself."""
    if "attention" not in layer_kinds(model):
        return None  # (no keys to shape)
    try:
        declared = model._get_static_cache_init_shape()  # private HF hook (tests/test_hf_internals.py guards it)
    except Exception as err:  # noqa: BLE001 - (5.17 reads a per-layer head_dim of Gemma 4 as one)
        return f"transformers cannot size its static cache before a forward (it raises {type(err).__name__})"
    if declared is None:
        return None
    cache = static_cache(model.config, 2)
    with torch.inference_mode():
        model(input_ids=torch.zeros(1, 1, dtype=torch.long, device=input_device(model)), use_cache=True,
              **cache_argument(cache, model))
    for i, layer in enumerate(cache.layers):
        heads, dim = (value[i] if isinstance(value, (list, tuple)) else value for value in declared)
        keys = getattr(layer, "keys", None) if getattr(layer, "is_initialized", False) else None  # (attention only)
        if keys is not None and tuple(keys.shape[1::2]) != (heads, dim):
            return (f"its attention keeps {keys.shape[1]} key heads of {keys.shape[-1]} where its config "
                    f"declares {heads} of {dim} (multi-query attention), so a static cache cannot be allocated for it "
                    "before the capture")
    return None


def host_work_problem(model: torch.nn.Module) -> str | None:
    """Why a captured step of ``model`` would fail on host work inside its forward (Falcon's new architecture indexes
    its fused heads with a Python list: a tensor made from host data at every step), or a state its cache does not
    hold (5.17's RecurrentGemma); read from a one-token read over a static cache, as a captured step reads
    (``fast/graphs.host_work`` says which ops a capture cannot take)."""
    cache, device = static_cache(model.config, 4), input_device(model)
    ids, mask = torch.zeros(1, 1, dtype=torch.long, device=device), torch.ones(1, 4, dtype=torch.long, device=device)

    def step(at: int) -> None:
        model(input_ids=ids, attention_mask=mask, position_ids=torch.full_like(ids, at), use_cache=True,
              logits_to_keep=torch.zeros(1, dtype=torch.long, device=device), **cache_argument(cache, model))

    with torch.inference_mode():
        step(0)
        problem = host_work(lambda: step(1))
    if problem is not None:
        return f"its forward works on the host at every step ({problem}), which a captured step cannot replay"
    if any(layer_written(layer) is False for layer in cache.layers):
        return "it keeps part of its state on its modules, not in its cache, which a captured step cannot replay"
    return None


# ------------------------------------------------------------------ reads of several tokens
def continues_problem(model: torch.nn.Module) -> str | None:
    """Why a read of several tokens into a cache that holds earlier ones would not give ``model``'s logits, or None.

    transformers' Mamba and FalconMamba scans start a read of several tokens from a zero state, and RecurrentGemma's
    convolution from zero inputs, whatever the cache holds (one token at a time, and a first read, are right).
    Checked on its own weights, whatever its cache's layers say (5.17's RecurrentGemma cache shows attention layers
    only): 3 tokens, then 5, against one forward over the 8, to fp32 rounding."""
    device = input_device(model)
    ids = (torch.arange(8, device=device)[None] * 37 + 3) % model.get_input_embeddings().weight.shape[0]
    positions, cache = torch.arange(8, device=device)[None], make_cache(model, None, 8)
    with torch.inference_mode():
        lm_forward(model, ids[:, :3], None, positions[:, :3], cache)
        got = lm_forward(model, ids[:, 3:], None, positions[:, 3:], cache, 0)[0].float()
        want = lm_forward(model, ids, None, positions, None, 0)[0, 3:].float()
    if close(got, want, model, 2e-5):  # (a read in pieces sums as one forward does, to fp32 rounding)
        return None
    return ("its forward over several tokens does not continue the state its cache holds (transformers computes part "
            "of such a read as if no token came before it)")


def close(got: torch.Tensor, want: torch.Tensor, model: torch.nn.Module, fp32: float = 1e-3) -> bool:
    """Two reads' logits agree within ``fp32`` in float32, bf16's rounding else (relative to the largest logit)."""
    tolerance = fp32 if model.dtype == torch.float32 else 5e-2
    return bool((got - want).abs().max() <= tolerance * want.abs().max().clamp(min=1e-6))


# ------------------------------------------------------------------ fusing
def fuse_problem(model: torch.nn.Module, measured: dict, slots: bool) -> str | None:
    """Why ``model``'s reads cannot be fused: its structure (by name), then the fused read (uncompiled) of a short
    sequence in two slots against the model's own forward, so a variant that computes otherwise is caught; allowed
    twice what HF's own read in slots departs by where it ``slots`` (``measured["slot_read_max_rel"]``: rounding —
    a deep model in bf16 departs far more than a tiny one; the random 32B's fused read was 6 % off on an H200, over
    the 5 % bf16 tolerance, while its captured HF reads departed 8 % from eager ones); a wrong structure is off by
    the logits' whole scale. ``measured["fuse_max_rel"]``, ``["fuse_tolerance"]``: what it found."""
    problem = structure_problem(model)
    if problem is not None:
        return problem
    own = measured.get("slot_read_max_rel") if slots else None
    found: dict = {}
    problem = slot_read_problem(model, lambda cache, tokens: _fused_piece(model, cache, tokens, start=4, count=3),
                                   "its fused forward failed", "its fused logits differ from its own forward", found,
                                   rounding=own or 0.0)
    measured.update(fuse_max_rel=found.get("max_rel"), fuse_tolerance=found.get("tolerance"))
    return problem


def structure_problem(model: torch.nn.Module) -> str | None:
    """Why ``model``'s modules are not the decoder ``fused.py`` fuses (checked by name and type), or None."""
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


def _fused_piece(model, cache: SlotCache, tokens: torch.Tensor, start: int, count: int) -> torch.Tensor:
    """Slot 1's logits after reading ``count`` more tokens through the plain fused regions (slot 0 idle)."""
    inputs = piece_inputs(tokens, [0, 1], [0, start], [0, count], count, cache.trash)
    read = slot_read(model, cache, hidden=False, regions=PLAIN)
    return read(**inputs)[0][1]


# ------------------------------------------------------------------ rollback
def rollback_problem(model: torch.nn.Module, stepwise: str | None = None) -> str | None:
    """Why a rollback (speculation) cannot cut ``model``'s cache back exactly, checked on its own weights: 4 tokens
    read (a recurrent or convolution state kept there, as ``generate``'s rollbacks keep it: ``compat.hold_states``),
    then 2 more, cut back by 2 and 2 others read; the logits must be those of one plain forward over the 6 tokens
    kept."""
    if long_rope_switch(model) is not None:
        return ("its long-context rotary factors follow the sequence's length, so a cut back across its original "
                "context would keep keys read with the other factors")
    device = input_device(model)
    ids = (torch.arange(8, device=device)[None] * 37 + 3) % model.get_input_embeddings().weight.shape[0]
    positions = torch.arange(6, device=device)[None]
    cache = make_cache(model, None, 8, rollback=2)

    def read(piece: slice, at: slice) -> torch.Tensor:  # (as R2R reads: one token at a time where it must)
        return cached_forward(model, ids[:, piece], positions[:, at], cache, 1, lambda i, j: None,
                              stepwise)[0, -1].float()

    with torch.inference_mode():
        try:
            read(slice(0, 4), slice(0, 4))
            held = hold_states(cache)
            read(slice(4, 6), slice(4, 6))
            if any(layer_written(layer) is False for layer in cache.layers):  # (a layer its forward never wrote)
                return "it keeps its recurrent state on its modules, not in its cache, so a cut back cannot reach it"
            crop_cache(cache, 2)
            restore_states(cache, held)
            got = read(slice(6, 8), slice(4, 6))
        except Exception as err:  # noqa: BLE001 - any failure means: it cannot be cut back
            return f"its cache cannot be cut back to an earlier token (transformers raises {type(err).__name__})"
        want = lm_forward(model, torch.cat([ids[:, :4], ids[:, 6:]], 1), None, positions, None)[0, -1].float()
    if not close(got, want, model):
        return "its state does not follow its cache when the cache is cut back (a state kept on its modules)"
    return None
