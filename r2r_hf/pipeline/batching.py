"""Continuous batching for the labeling run: greedy rows of one model decoded together; a row that ends leaves at
once and a waiting row takes its place (as the server's slots do), so no step decodes padding.

The rows share one left-padded rectangle: each layer's keys and values [rows, heads, width, dim] and a mask [rows,
width]. A row joins with the keys and values of what it has read (a prompt read alone, or a cut of another row's
cache: a continuation starts from its answer's), left-padded to the rectangle's width (or the rectangle widened to
it), and with the one token it reads next (``feed``). A step feeds every row's next token, takes the argmax of
its logits as the row's next token, and the rows that end leave; columns that no row uses any more are cut.

An answer here is the greedy answer ``generate`` gives (positions from the mask, padding masked out); in bf16 it may
differ from a differently batched one where two logits lie within rounding, as any two batchings may.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers.cache_utils import DynamicCache

from ..core.features import HiddenStateCapture, lm_forward

KV = list[tuple[torch.Tensor, torch.Tensor]]  # per layer: keys and values [1, heads, length, dim] of one row


@dataclass
class Row:
    """One greedy row.

    Args:
        key: the caller's handle.
        feed: the token it reads next (its last prompt token, or the token a continuation starts from).
        max_new: it ends after writing this many tokens ...
        stops: ... or once it writes one of these.
        keep_hidden: keep the model's last hidden state (post-norm) of every step (``hidden``).
    """

    key: Any
    feed: int
    max_new: int
    stops: frozenset[int]
    keep_hidden: bool = False
    written: list[int] = field(default_factory=list)
    hidden: list[torch.Tensor] = field(default_factory=list)
    kv: KV | None = None  # set when it ends, where asked: the cache of what it read (all but its last token)

    @property
    def done(self) -> bool:
        return bool(self.written) and (self.written[-1] in self.stops or len(self.written) >= self.max_new)


@torch.no_grad()
def read_alone(model, tokens: list[int]) -> KV:
    """The keys and values of ``tokens`` read by ``model`` alone (one forward, no padding)."""
    if not tokens:
        return empty_kv(model)
    cache = DynamicCache(config=model.config)
    lm_forward(model, torch.tensor([tokens]), None, None, cache)
    return [(layer.keys, layer.values) for layer in cache.layers]


def empty_kv(model) -> KV:
    """The cache of a row that has read nothing: every layer's keys and values of length 0."""
    config = model.config.get_text_config()
    heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    weight = model.get_input_embeddings().weight
    empty = torch.zeros(1, heads, 0, dim, dtype=weight.dtype, device=weight.device)
    return [(empty, empty) for _ in range(config.num_hidden_layers)]


def cut(kv: KV, length: int) -> KV:
    """The first ``length`` positions of one row's cache."""
    return [(k[:, :, :length], v[:, :, :length]) for k, v in kv]


def _pad_left(x: torch.Tensor, width: int, dim: int) -> torch.Tensor:
    missing = width - x.shape[dim]
    if missing <= 0:
        return x
    shape = list(x.shape)
    shape[dim] = missing
    return torch.cat([x.new_zeros(shape), x], dim=dim)


class Batch:
    """The rows being decoded and their shared cache (see the module docstring).

    Args:
        model: the causal LM that writes every row.
        capacity: at most this many rows decode together.
    """

    def __init__(self, model, capacity: int) -> None:
        self.model, self.capacity = model, capacity
        self.rows: list[Row] = []
        self.cache = DynamicCache(config=model.config)
        self.mask = torch.zeros(0, 0, dtype=torch.long)

    @property
    def free(self) -> int:
        return self.capacity - len(self.rows)

    def join(self, row: Row, kv: KV) -> None:
        """Add ``row``, whose cache of what it read is ``kv`` (``read_alone`` or a ``cut``)."""
        if self.free <= 0:
            raise RuntimeError("The batch is full; join a row after one has left.")
        kv = kv or empty_kv(self.model)
        width = max(self.mask.shape[1], kv[0][0].shape[2])
        row_mask = _pad_left(torch.ones(1, kv[0][0].shape[2], dtype=torch.long), width, 1)
        if not self.rows:
            self.cache, self.mask = DynamicCache(config=self.model.config), row_mask
            for index, (k, v) in enumerate(kv):
                self.cache.update(_pad_left(k, width, 2), _pad_left(v, width, 2), index)
        else:
            self.mask = torch.cat([_pad_left(self.mask, width, 1), row_mask])
            for layer, (k, v) in zip(self.cache.layers, kv):
                layer.keys = torch.cat([_pad_left(layer.keys, width, 2), _pad_left(k, width, 2)])
                layer.values = torch.cat([_pad_left(layer.values, width, 2), _pad_left(v, width, 2)])
        self.rows.append(row)

    @torch.no_grad()
    def step(self, keep_cache: bool = False) -> list[Row]:
        """Every row reads its next token (``feed``) and writes the one after; returns the rows that ended (they have left).

        Args:
            keep_cache: an ended row that asked for ``keep_hidden`` keeps its cache (``Row.kv``) for continuations.
        """
        if not self.rows:
            return []
        ids = torch.tensor([[r.feed] for r in self.rows])
        positions = self.mask.sum(-1, keepdim=True)  # each row's next position: the tokens it has read
        mask = torch.cat([self.mask, torch.ones(len(self.rows), 1, dtype=torch.long)], dim=1)
        with HiddenStateCapture(self.model) as capture:
            logits = lm_forward(self.model, ids, mask, positions, self.cache)[:, -1]
            hidden = capture.hidden[:, -1]
        self.mask = mask
        tokens = logits.argmax(-1).tolist()
        for r, (row, token) in enumerate(zip(self.rows, tokens)):
            row.written.append(token)
            row.feed = token
            if row.keep_hidden:
                row.hidden.append(hidden[r].clone())  # a copy: a view would keep the whole step's states alive
        ended = [r for r, row in enumerate(self.rows) if row.done]
        for r in ended:
            row = self.rows[r]
            if keep_cache and row.keep_hidden:  # what it read: all but the token it wrote last
                real = self.mask[r].bool()
                row.kv = [(layer.keys[r : r + 1, :, real], layer.values[r : r + 1, :, real])
                          for layer in self.cache.layers]
        finished = [self.rows[r] for r in ended]
        if ended:
            self._leave(ended)
        return finished

    def _leave(self, ended: Iterable[int]) -> None:
        """Drop the ended rows, then the leading columns no remaining row uses."""
        gone = set(ended)
        keep = torch.tensor([r for r in range(len(self.rows)) if r not in gone], dtype=torch.long)
        self.rows = [row for r, row in enumerate(self.rows) if r not in gone]
        self.mask = self.mask[keep]
        used = self.mask.any(0).nonzero()
        first = int(used[0]) if len(used) else self.mask.shape[1]
        self.mask = self.mask[:, first:]
        for layer in self.cache.layers:
            layer.keys = layer.keys[keep, :, first:]
            layer.values = layer.values[keep, :, first:]
