"""Rows joining and leaving a running batch between steps (iteration-level, "continuous" batching).

A batch decodes left-aligned rows: every row's newest token sits in the last committed column and
shorter rows are padded on the left (mask 0, never attended to). So a row can join at any step:

* ``merge`` puts two batches side by side: the shorter one is padded on the left until both end at
  the same column, in the committed buffers and in both models' KV caches (zero keys and values
  under a 0 mask). The LLM has read the first ``llm_seen`` columns of the running batch (one lag
  shared by the batch); the newcomers' LLM cache is first filled up to the same column, so the
  merged batch keeps one lag and the next catch-up reads every row's unseen tokens.
* ``select`` keeps some rows (finished ones leave) and then drops the columns that are padding in
  every row that is left, so a long-lived batch does not grow without end.

Only eager dynamic caches with full-attention layers are spliced (``splice_problem`` says why not);
positions are per row (from its own first real token), so neither padding nor trimming changes what
a row computes: a row answers what it would answer alone, up to float rounding.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import DynamicCache, DynamicLayer

from .decoding import Batch
from .engines import EagerSteps
from .features import lm_forward
from .steps import Committed


def splice_problem(model: torch.nn.Module) -> str | None:
    """Why rows cannot join or leave a batch of ``model`` mid-way, or None when they can."""
    layers = DynamicCache(config=model.config).layers
    if not all(type(layer) is DynamicLayer for layer in layers):
        return "it has sliding-window or other non-full-attention cache layers"
    return None


# ----------------------------------------------------------------- committed buffers
def _placed(seq: Committed, shift: int, capacity: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``seq``'s buffers moved ``shift`` columns right inside buffers of ``capacity`` columns."""
    batch, length = seq.ids.shape[0], seq.length
    ids = seq.ids.new_zeros(batch, capacity)
    mask = seq.mask.new_ones(batch, capacity)
    positions = seq.positions.new_zeros(batch, capacity)
    ids[:, shift : shift + length] = seq.ids[:, :length]
    mask[:, :shift] = 0
    mask[:, shift : shift + length] = seq.mask[:, :length]
    positions[:, shift : shift + length] = seq.positions[:, :length]
    after = capacity - shift - length
    last = seq.positions[:, length - 1 : length]
    positions[:, shift + length :] = last + torch.arange(1, after + 1, device=last.device)
    return ids, mask, positions


def grown(seq: Committed, capacity: int) -> Committed:
    """``seq`` in buffers of at least ``capacity`` columns (the same object when it already fits)."""
    if capacity <= seq.ids.shape[1]:
        return seq
    return Committed(*_placed(seq, 0, capacity), seq.length, padded=True)


# ----------------------------------------------------------------- KV caches
def _kv(cache: DynamicCache) -> list[tuple[torch.Tensor, torch.Tensor] | None]:
    """Each layer's (keys, values) [B, heads, T, dim], or None where the layer holds nothing yet."""
    return [(layer.keys, layer.values) if layer.get_seq_length() > 0 else None for layer in cache.layers]


def _cache_of(model: torch.nn.Module, kv: list[tuple[torch.Tensor, torch.Tensor] | None]) -> DynamicCache:
    cache = DynamicCache(config=model.config)
    for layer, pair in zip(cache.layers, kv):
        if pair is not None:
            layer.lazy_initialization(*pair)
            layer.keys, layer.values = pair
    return cache


def _pad_left(pair: tuple[torch.Tensor, torch.Tensor], columns: int) -> tuple[torch.Tensor, torch.Tensor]:
    return tuple(torch.nn.functional.pad(t, (0, 0, columns, 0)) for t in pair)


def _merged_kv(a, b, rows_a: int, rows_b: int, length: int):
    """Per layer, a's and b's KV (each padded on the left to ``length`` columns) stacked along the batch."""
    merged = []
    for pa, pb in zip(a, b):
        like = pa if pa is not None else pb
        if like is None or length == 0:
            merged.append(None)
            continue
        sides = []
        for pair, rows in ((pa, rows_a), (pb, rows_b)):
            if pair is None:  # nothing read yet on this side: padding only
                shape = (rows, like[0].shape[1], length, like[0].shape[3])
                pair = (like[0].new_zeros(shape), like[1].new_zeros(shape))
            sides.append(_pad_left(pair, length - pair[0].shape[2]))
        merged.append(tuple(torch.cat([sa, sb]) for sa, sb in zip(*sides)))
    return merged


# ----------------------------------------------------------------- join and leave
def merge(running: Batch, steps: EagerSteps, newcomers: Batch, new_steps: EagerSteps) -> Batch:
    """One batch of ``running``'s rows then ``newcomers``' rows; ``steps`` takes the merged caches.

    ``newcomers`` has been prefilled by the SLM only (``llm_seen == 0``).
    """
    if (running.budget is None) != (newcomers.budget is None):  # joining would drop one side's budgets
        raise ValueError("Rows with a budget state and rows without one cannot join; start both with one "
                         "(llm_budget=inf for rows without a budget).")
    a, b = running.seq, newcomers.seq
    length = max(a.length, b.length)
    shift_a, shift_b = length - a.length, length - b.length
    # The merged lag: the LLM has read the running rows up to llm_seen (plus the padding they gain); the
    # newcomers are brought to the same column.
    seen = running.llm_seen + shift_a
    prefix = seen - shift_b  # newcomer columns (their own numbering) the LLM must read now
    if prefix > 0:
        lm_forward(new_steps.llm, b.ids[:, :prefix], b.mask[:, :prefix], b.positions[:, :prefix], new_steps.llm_cache)
    capacity = max(a.ids.shape[1] + shift_a, b.ids.shape[1] + shift_b)
    parts = [_placed(a, shift_a, capacity), _placed(b, shift_b, capacity)]
    seq = Committed(*(torch.cat([pa, pb]) for pa, pb in zip(*parts)), length, padded=True)
    rows_a, rows_b = a.ids.shape[0], b.ids.shape[0]
    steps.slm_cache = _cache_of(steps.slm, _merged_kv(_kv(steps.slm_cache), _kv(new_steps.slm_cache),
                                                      rows_a, rows_b, length))
    steps.llm_cache = _cache_of(steps.llm, _merged_kv(_kv(steps.llm_cache), _kv(new_steps.llm_cache),
                                                      rows_a, rows_b, seen))
    logits = torch.cat([running.slm_logits, newcomers.slm_logits.to(running.slm_logits.device)])
    hidden = torch.cat([running.slm_hidden, newcomers.slm_hidden.to(running.slm_hidden.device)])
    budget = None if running.budget is None else running.budget.joined(newcomers.budget)
    return Batch(seq, seen, logits, hidden, budget)


def _kept(kv, rows: torch.Tensor, start: int, stop: int | None = None):
    return [None if pair is None else tuple(t[rows.to(t.device), :, start:stop] for t in pair) for pair in kv]


def select(batch: Batch, steps: EagerSteps, keep: list[int]) -> Batch:
    """The batch of rows ``keep`` (in that order), without the columns that are padding in all of them."""
    rows = torch.tensor(keep, dtype=torch.long, device=batch.seq.ids.device)
    seq, length = batch.seq, batch.seq.length
    mask = seq.mask[rows, :length]
    # Every row holds a real token (its prompt's last at least), so argmax finds each row's first one.
    start = int(mask.argmax(-1).min())
    kept = Committed(seq.ids[rows, start:].clone(), seq.mask[rows, start:].clone(), seq.positions[rows, start:].clone(),
                     length - start, padded=True)
    seen = max(batch.llm_seen - start, 0)
    steps.slm_cache = _cache_of(steps.slm, _kept(_kv(steps.slm_cache), rows, start))
    # Columns the LLM read before ``start`` are padding in every kept row: dropped with the rest.
    steps.llm_cache = _cache_of(steps.llm, _kept(_kv(steps.llm_cache), rows, start, start + seen) if seen else
                                [None] * len(steps.llm_cache.layers))
    logits, hidden = batch.slm_logits[rows.to(batch.slm_logits.device)], batch.slm_hidden[rows.to(batch.slm_hidden.device)]
    budget = None if batch.budget is None else batch.budget.rows(rows.to(batch.budget.share.device))
    return Batch(kept, seen, logits, hidden, budget)
