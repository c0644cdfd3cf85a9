"""Fused steps: the decoder's forward over HF's own modules, one compiled region reused by every layer.

Why: a CUDA graph replays every kernel its capture launched, and HF's eager forward launches ~1,150 per 1.5B
token (RMSNorm's casts, rotary, the KV write, ``repeat_kv`` copies of the cache, a mask per layer), most of
them tiny: at ~2 us each inside a graph they, not the weights, set a captured step's time (issue 32). Here a
read is written as small functions over explicit tensors, each compiled once by inductor without its own
CUDA graphs (``REGION_OPTIONS``), and the whole read is then captured as before (``graphs.py``):

* a prologue (``static_prologue``, ``slot_prologue``): the embedding, the rotary cos/sin and the one attention
  mask of the forward;
* a layer (``static_layer``, ``slot_layer``): a decoder layer through HF's own submodules (norms, o/down
  projections, the modeling file's ``apply_rotary_pos_emb``), with q/k/v and gate/up each one GEMM over
  packed weights (``pack``: the HF parameters become views of them, nothing is copied). The same compiled
  code serves every layer of a model (the layer's weights and its K/V buffers are inputs, not constants), so
  a cold compile costs one layer's, not the model's. GQA attends without copying the cache per query head:
  the query heads of one KV head are read as rows of one attention (``packed_queries``), which every sdpa
  kernel takes with a mask;
* ``head``: the final norm and ``lm_head`` at the last real token (and the SLM's post-norm hidden state);
  ``kept_head`` (uncompiled) at the positions a speculative resolution judges.

Attention reads the filled columns only, rounded up to a power of two (``attended``), decided on the host
from lengths the loop already knows. Only decoder layers of the shape above are fused (``FUSABLE``); a
model whose fused logits differ from its own forward is not (``fuse_problem`` checks once per model), and
the caller captures HF's forward instead.
"""

from __future__ import annotations

import logging
import sys

import torch
import torch.nn.functional as F

from ..notes import notes

logger = logging.getLogger(__name__)

# Decoders whose layer is: x + attn(norm(x)) then x + mlp(norm(x)), rotary positions, no sliding window.
FUSABLE = ("llama", "qwen2", "qwen3", "mistral")
# Inductor fuses each region's pointwise work; CUDA graphs are ours (the whole read is one graph), so inductor
# makes none. ``dynamic``: one compile serves every rows/tokens/attended bucket.
REGION_OPTIONS = {"mode": "default", "dynamic": None, "fullgraph": True}
# Attention spans at least this many columns: shorter buckets would multiply captures for little traffic.
MIN_ATTENDED = 256


def attended(filled: int, capacity: int) -> int:
    """The columns a read attends: ``filled`` rounded up to a power of two (at least ``MIN_ATTENDED``, at most
    ``capacity``). Columns past ``filled`` are masked anyway; reading fewer of them reads less of the cache."""
    span = MIN_ATTENDED
    while span < filled:
        span *= 2
    return min(span, capacity)


# ------------------------------------------------------------------ packed projections
def pack(linears: list[torch.nn.Linear]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One weight (and bias) for linears that read the same input: one GEMM and one epilogue instead of three.

    The linears' own parameters become views of it: the same values in the same memory, so HF's forward, a
    saved checkpoint (disjoint views are saved apart) and the memory used are unchanged. Made outside any
    inference mode, so the parameters stay usable for training."""
    with torch.inference_mode(False), torch.no_grad():
        weight = torch.cat([linear.weight for linear in linears])
        biased = linears[0].bias is not None
        bias = torch.cat([linear.bias for linear in linears]) if biased else None
        sizes = [linear.out_features for linear in linears]
        for linear, w, b in zip(linears, weight.split(sizes), bias.split(sizes) if biased else [None] * len(sizes)):
            linear.weight.data = w
            if biased:
                linear.bias.data = b
    return weight, bias


def packable(linears: list[torch.nn.Module]) -> bool:
    """Plain ``nn.Linear`` layers (no quantised or offloaded weights, no hooks) alike in device, dtype and bias."""
    first = linears[0]
    return all(type(m) is torch.nn.Linear and not getattr(m, "_hf_hook", None) and not m._forward_hooks
               and not m._forward_pre_hooks and m.weight.device == first.weight.device != torch.device("meta")
               and m.weight.dtype == first.weight.dtype and (m.bias is None) == (first.bias is None)
               for m in linears)


def layer_weights(layer: torch.nn.Module) -> tuple[torch.Tensor, ...]:
    """(q/k/v weight, its bias or None, gate/up weight, its bias or None) of a layer, packed on first use and again
    whenever one of its linears' weights was replaced (``weight.data = ...``, ``load_state_dict(assign=True)``):
    packed weights that are no longer the linears' own would be read stale. Kept in the core's notes on the layer
    (not a submodule or parameter: state_dict is unchanged)."""
    attn, mlp = layer.self_attn, layer.mlp
    linears = (attn.q_proj, attn.k_proj, attn.v_proj, mlp.gate_proj, mlp.up_proj)
    known = notes(layer)
    if known.get("packed_at") != addresses(linears):
        known["packed"] = (*pack([attn.q_proj, attn.k_proj, attn.v_proj]), *pack([mlp.gate_proj, mlp.up_proj]))
        known["packed_at"] = addresses(linears)
    return known["packed"]


def addresses(modules) -> tuple[int, ...]:
    """Where each parameter of ``modules`` lives: a weight replaced (not written in place) moves."""
    return tuple(p.data_ptr() for m in modules for p in m.parameters())


# ------------------------------------------------------------------ the regions (pure functions of tensors)
def prologue(model: torch.nn.Module, ids: torch.Tensor, position: torch.Tensor, allowed: torch.Tensor, groups: int):
    """Embeddings [B, b, H], rotary (cos, sin) [B, b, D] and the packed mask [B, 1, G*b, L] of one forward.

    ``allowed`` [B, b, L] says which columns each new token attends.
    """
    inner = model.model
    x = inner.embed_tokens(ids)
    cos, sin = inner.rotary_emb(x, position)
    rows, width, columns = allowed.shape
    mask = allowed[:, None, None].expand(rows, 1, groups, width, columns).reshape(rows, 1, groups * width, columns)
    return x, cos, sin, mask.contiguous()  # one layout whatever the compiled entry (a graph keeps its capture's)


def static_prologue(model, ids, positions, mask, lengths, groups: int, span: int):
    """``prologue`` over HF's static cache: the new tokens' columns follow ``lengths`` [] (every row alike); a
    token sees the real columns (``mask`` [B, L]) up to its own, a left-padding token itself (no row of NaN)."""
    width = ids.shape[1]
    column = torch.arange(width, device=ids.device) + lengths
    columns = torch.arange(span, device=ids.device)
    allowed = (mask[:, None, :span].bool() & (columns <= column[:, None])) | (columns == column[:, None])
    return (*prologue(model, ids, positions, allowed, groups), column)


def slot_prologue(model, ids, position, real, groups: int, span: int):
    """``prologue`` over slots: a real token sees its row's columns up to its position, padding column 0."""
    columns = torch.arange(span, device=ids.device)
    allowed = torch.where(real[..., None], columns <= position[..., None], columns == 0)
    return prologue(model, ids, position, allowed, groups)


def packed_queries(q: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """[B, H, b, D] -> [B, Hkv, G*b, D]: query head ``h`` reads KV head ``h // G`` (HF's ``repeat_kv``), so the G
    query heads of one KV head become G*b rows of one attention over that head's keys: no copy of the cache."""
    rows, heads, width, dim = q.shape
    return q.reshape(rows, kv_heads, (heads // kv_heads) * width, dim)


def project(layer: torch.nn.Module, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, qkv, qkv_bias):
    """The layer's queries [B, H, b, D] and keys, values [B, Hkv, b, D] (rotary applied), as HF computes them,
    from one packed GEMM (``pack``)."""
    attn = layer.self_attn
    h = layer.input_layernorm(x)
    sizes = [attn.q_proj.out_features, attn.k_proj.out_features, attn.v_proj.out_features]
    shape = (*h.shape[:-1], -1, attn.head_dim)
    q, k, v = (part.view(shape) for part in F.linear(h, qkv, qkv_bias).split(sizes, dim=-1))
    if hasattr(attn, "q_norm"):  # Qwen3 normalises each head before rotary
        q, k = attn.q_norm(q), attn.k_norm(k)
    q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    rotary = sys.modules[type(attn).__module__].apply_rotary_pos_emb
    q, k = rotary(q, k, cos, sin)
    return q, k, v


def attend_and_finish(layer, x, q, keys, values, mask, gate_up, gate_up_bias):
    """Attention of ``q`` over ``keys``/``values`` [B, Hkv, L, D] under ``mask``, then the rest of the layer."""
    rows, heads, width, dim = q.shape
    out = F.scaled_dot_product_attention(packed_queries(q, keys.shape[1]), keys, values, attn_mask=mask,
                                         scale=layer.self_attn.scaling)
    return finish(layer, x, out.reshape(rows, heads, width, dim).transpose(1, 2).reshape(rows, width, heads * dim),
                  gate_up, gate_up_bias)


def finish(layer, x, attended, gate_up, gate_up_bias):
    """The layer after its attention: the output projection's residual, then the MLP (its gate and up projections as
    one packed GEMM)."""
    mlp = layer.mlp
    x = x + layer.self_attn.o_proj(attended)
    gate, up = F.linear(layer.post_attention_layernorm(x), gate_up, gate_up_bias).chunk(2, dim=-1)
    return x + mlp.down_proj(mlp.act_fn(gate) * up)


def static_layer(layer, x, cos, sin, mask, keys, values, column, weights, span: int):
    """One layer over HF's static cache: the new K/V go to ``column`` [b] of every row; attention reads ``span``."""
    q, k, v = project(layer, x, cos, sin, weights[0], weights[1])
    keys.index_copy_(2, column, k)
    values.index_copy_(2, column, v)
    return attend_and_finish(layer, x, q, keys[:, :, :span], values[:, :, :span], mask, weights[2], weights[3])


def slot_layer(layer, x, cos, sin, mask, keys, values, column, weights, span: int, slots=None):
    """One layer over slots: row ``r``'s new K/V go to its ``column[r]`` [k, b]; rows are the first k slots, or
    ``slots`` [k] (a read that gathers its rows: their keys and values over ``span`` columns are copied out)."""
    q, k, v = project(layer, x, cos, sin, weights[0], weights[1])
    rows = (torch.arange(x.shape[0], device=x.device) if slots is None else slots)[:, None]
    keys[rows, :, column] = k.transpose(1, 2)
    values[rows, :, column] = v.transpose(1, 2)
    if slots is None:
        count = x.shape[0]
        seen_keys, seen_values = keys[:count, :, :span], values[:count, :, :span]
    else:
        seen_keys, seen_values = keys[:, :, :span].index_select(0, slots), values[:, :, :span].index_select(0, slots)
    return attend_and_finish(layer, x, q, seen_keys, seen_values, mask, weights[2], weights[3])


def packed_prologue(model, ids, position, qpos, groups: int, span: int):
    """``prologue`` of a packed read (``layouts/packed.py``): the flat tokens as one row [1, T, H], and the mask of
    the attention layout from each place's position ``qpos`` [S, g] (-1: no query there, it sees column 0)."""
    columns = torch.arange(span, device=ids.device)
    allowed = torch.where(qpos[..., None] >= 0, columns <= qpos[..., None], columns == 0)  # [S, g, span]
    return prologue(model, ids[None], position[None], allowed, groups)


def packed_layer(layer, x, cos, sin, mask, keys, values, slot, column, place, weights, span: int):
    """One layer of a packed read: the flat tokens' projections and MLP over [1, T] (the real tokens and the bucket's
    slack only); token ``t``'s K/V go to ``column[t]`` of ``slot[t]``; attention places each query at ``place[t]``
    of the [S x g] layout (an extra place past it takes the padding) and attends every slot's keys in place (the
    mask keeps each query to its own row)."""
    q, k, v = project(layer, x, cos, sin, weights[0], weights[1])  # [1, H, T, D], [1, Hkv, T, D]
    keys[slot, :, column] = k[0].transpose(0, 1)
    values[slot, :, column] = v[0].transpose(0, 1)
    slots, heads, dim = keys.shape[0], q.shape[1], q.shape[3]
    places = mask.shape[2] // (heads // keys.shape[1]) * slots
    laid = q.new_zeros(places + 1, heads, dim).index_copy(0, place, q[0].transpose(0, 1))[:places]
    laid = laid.view(slots, places // slots, heads, dim).transpose(1, 2)  # [S, H, g, D]
    out = F.scaled_dot_product_attention(packed_queries(laid, keys.shape[1]), keys[:, :, :span],
                                         values[:, :, :span], attn_mask=mask, scale=layer.self_attn.scaling)
    out = out.reshape(slots, heads, places // slots, dim).transpose(1, 2).reshape(places, heads * dim)
    out = out.index_select(0, place.clamp(max=places - 1))[None]  # back to the flat order (padding reads junk)
    return finish(layer, x, out, weights[2], weights[3])


def packed_head(model: torch.nn.Module, x: torch.Tensor, keep: torch.Tensor, hidden: bool):
    """Logits [L, V] (and post-norm hidden states [L, H]) at the flat positions ``keep`` [L] of a packed read."""
    h = model.model.norm(x[0].index_select(0, keep))
    logits = model.lm_head(h)
    return (logits, h) if hidden else (logits,)


def kept_head(model: torch.nn.Module, x: torch.Tensor, keep: torch.Tensor):
    """Logits [B, n, V] after the tokens ``keep`` [n] of ``x`` [B, b, H] (a speculative resolution's read: the
    positions it judges only, not the whole piece's). Not compiled: ``lm_head``'s GEMM is the cost, and the capture
    records it as it runs (no region compile per rows x tokens x kept class)."""
    return (model.lm_head(model.model.norm(x.index_select(1, keep))),)


def head(model: torch.nn.Module, x: torch.Tensor, last: torch.Tensor | None, hidden: bool):
    """Logits [B, V] (and the post-norm hidden state [B, H]) at token ``last`` [1] of ``x`` [B, b, H] (None: the
    last token)."""
    h = model.model.norm(x[:, -1] if last is None else x.index_select(1, last)[:, 0])
    logits = model.lm_head(h)
    return (logits, h) if hidden else (logits,)
