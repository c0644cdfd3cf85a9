"""Fused steps: the decoder's forward over HF's own modules, one compiled region reused by every layer.

Why: a CUDA graph replays every kernel its capture launched, and HF's eager forward launches ~1,150 per 1.5B
token (RMSNorm's casts, rotary, the KV write, ``repeat_kv`` copies of the cache, a mask per layer), most of
them tiny: at ~2 us each inside a graph they, not the weights, set a captured step's time (issue 32). Here a
read is written as three small functions over explicit tensors, each compiled once by inductor without its
own CUDA graphs (``REGION_OPTIONS``), and the whole read is then captured as before (``graphs.py``):

* ``prologue``: the embedding, the rotary cos/sin and the one attention mask of the forward;
* ``layer``: a decoder layer through HF's own submodules (norms, projections, MLP, the modeling file's
  ``apply_rotary_pos_emb``). The same compiled code serves every layer of a model (the layer's weights and
  its K/V buffers are inputs, not constants), so a cold compile costs one layer's, not the model's. GQA
  attends without copying the cache per query head: the query heads of one KV head are read as rows of one
  attention (``packed_queries``), which every sdpa kernel takes with a mask;
* ``head``: the final norm and ``lm_head`` at the last real token (and the SLM's post-norm hidden state).

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


def packed_queries(q: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """[B, H, b, D] -> [B, Hkv, G*b, D]: query head ``h`` reads KV head ``h // G`` (HF's ``repeat_kv``), so the G
    query heads of one KV head become G*b rows of one attention over that head's keys: no copy of the cache."""
    rows, heads, width, dim = q.shape
    return q.reshape(rows, kv_heads, (heads // kv_heads) * width, dim)


def project(layer: torch.nn.Module, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
    """The layer's queries [B, H, b, D] and keys, values [B, Hkv, b, D] (rotary applied), as HF computes them."""
    attn = layer.self_attn
    h = layer.input_layernorm(x)
    shape = (*h.shape[:-1], -1, attn.head_dim)
    q, k, v = attn.q_proj(h).view(shape), attn.k_proj(h).view(shape), attn.v_proj(h).view(shape)
    if hasattr(attn, "q_norm"):  # Qwen3 normalises each head before rotary
        q, k = attn.q_norm(q), attn.k_norm(k)
    q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    rotary = sys.modules[type(attn).__module__].apply_rotary_pos_emb
    q, k = rotary(q, k, cos, sin)
    return q, k, v


def attend_and_finish(layer, x, q, keys, values, mask):
    """Attention of ``q`` over ``keys``/``values`` [B, Hkv, L, D] under ``mask``, then the rest of the layer."""
    attn = layer.self_attn
    rows, heads, width, dim = q.shape
    out = F.scaled_dot_product_attention(packed_queries(q, keys.shape[1]), keys, values, attn_mask=mask,
                                         scale=attn.scaling)
    out = out.reshape(rows, heads, width, dim).transpose(1, 2).reshape(rows, width, heads * dim)
    x = x + attn.o_proj(out)
    return x + layer.mlp(layer.post_attention_layernorm(x))


def static_layer(layer, x, cos, sin, mask, keys, values, column, span: int):
    """One layer over HF's static cache: the new K/V go to ``column`` [b] of every row; attention reads ``span``."""
    q, k, v = project(layer, x, cos, sin)
    keys.index_copy_(2, column, k)
    values.index_copy_(2, column, v)
    return attend_and_finish(layer, x, q, keys[:, :, :span], values[:, :, :span], mask)


def slot_layer(layer, x, cos, sin, mask, keys, values, column, span: int):
    """One layer over slots: row ``r``'s new K/V go to its ``column[r]`` [k, b]; rows are the first k slots."""
    q, k, v = project(layer, x, cos, sin)
    rows = torch.arange(x.shape[0], device=x.device)[:, None]
    keys[rows, :, column] = k.transpose(1, 2)
    values[rows, :, column] = v.transpose(1, 2)
    count = x.shape[0]
    return attend_and_finish(layer, x, q, keys[:count, :, :span], values[:count, :, :span], mask)


def head(model: torch.nn.Module, x: torch.Tensor, hidden: bool):
    """Logits [B, V] (and the post-norm hidden state [B, H]) at ``x`` [B, H], the last real token."""
    h = model.model.norm(x)
    logits = model.lm_head(h)
    return (logits, h) if hidden else (logits,)
