"""The LLM's packed reads (``layouts/packed.py``) on the fast path: fused, captured per shape bucket, replayed.

Every LLM forward of the server — a catch-up, a speculative resolution, a piece of a joining prompt — reads one flat
list of tokens from any slots, padded only to a bucket of its total, attends each token's own slot in place and
returns logits only where they are needed. A captured packed read is keyed by its tokens bucket, its group (the
attention layout's row length), the columns it attends (``fused.attended``) and how many logits it returns (one per
slot for a catch-up; one per slot and pending position for a resolution). Its inputs are index tensors, so one
capture serves every mix of rows of its shape (vLLM keys its graphs on the token count the same way).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from . import fused
from .fused_reads import Regions, _dynamic, _groups, allocate, capture_fused
from .graphs import Step
from ..layouts.packed import Packed, inputs, shapes
from ..layouts.reads import PackedReads
from ..layouts.slot_cache import SlotCache


def packed_read(model: torch.nn.Module, cache: SlotCache, regions: Regions, span: int) -> Step:
    """(ids, position, slot, column, place [T], qpos [S, g], keep [L]) -> logits [L, V]: a packed read attending the
    first ``span`` columns of every slot."""
    groups = _groups(model)
    weights = [fused.layer_weights(layer) for layer in model.model.layers]
    allocate(model, cache)

    def read(ids, position, slot, column, place, qpos, keep):
        _dynamic((ids, 0), (position, 0), (slot, 0), (column, 0), (place, 0), (qpos, 1), (keep, 0))
        x, cos, sin, mask = regions.packed_prologue(model, ids, position, qpos, groups, span)
        _dynamic((x, 1), (cos, 1), (sin, 1), (mask, 2))
        for i, (layer, w) in enumerate(zip(model.model.layers, weights)):
            x = regions.packed_layer(layer, x, cos, sin, mask, cache.keys[i], cache.values[i], slot, column, place,
                                     w, span)
            _dynamic((x, 1))
        return regions.packed_head(model, x, keep, False)

    return read


class PackedSteps:
    """A model's packed reads over a slot cache: captured per (tokens, group, span, kept) bucket with ``capture``, or
    run as they are (``capture`` None: eagerly, with ``regions`` plain or compiled).

    Args:
        model: the LLM.
        cache: its slot cache (static once captured).
        regions: the fused regions it runs (``fused_reads.fused_regions``, or ``fused_reads.PLAIN``).
        kept: logits a read returns, by whether it resolves pending positions (one per slot and position).
        capture: turns a step and example inputs into a captured step (None: run eagerly).
    """

    fused = True  # (what the capture report asks of the LLM's steps)

    def __init__(self, model: torch.nn.Module, cache: SlotCache, regions: Regions, kept: dict[bool, int],
                 capture: Callable[[Step, dict], Step] | None = None) -> None:
        self.model, self.cache, self.regions, self.kept, self.capture = model, cache, regions, kept, capture
        self.steps: dict[tuple[int, int, int, int], Step] = {}

    def reads(self) -> PackedReads:
        """The layout's reads of the LLM replaying these steps (``layouts/reads.py``)."""
        return PackedReads(self)

    def read(self, tokens: torch.Tensor, plan: Packed) -> torch.Tensor:
        """The logits [len(plan.keep), V] after each kept position of ``plan``, read from ``tokens`` [S, C]."""
        span = fused.attended(max(s + n for s, n in zip(plan.starts, plan.counts)), self.cache.capacity)
        example = inputs(plan, tokens, self.cache.trash)
        example["qpos"] = example["qpos"].view(self.cache.slots, plan.group)
        logits = self.step(plan.width, plan.group, span, plan.kept, example)(**example)[0]
        return logits[: len(plan.keep)]

    def step(self, width: int, group: int, span: int, kept: int, example: dict) -> Step:
        key = (width, group, span, kept)
        if key not in self.steps:
            fn = packed_read(self.model, self.cache, self.regions, span)
            if self.capture is None:
                self.steps[key] = fn
            else:
                step = capture_fused(self.capture, lambda: fn, example, type(self.model).__name__)
                if step is None:
                    raise RuntimeError(f"{type(self.model).__name__}'s packed read did not compile")
                self.steps[key] = step
        return self.steps[key]

    def warm(self, tokens: torch.Tensor, spans: tuple[int, ...]) -> int:
        """Capture every shape bucket with inputs that write nothing (every position padding); the number captured.
        Largest first (the smaller graphs reuse the blocks the larger left in the pool)."""
        slots = self.cache.slots
        for width, group in reversed(shapes(slots)):
            for span in reversed(spans):
                for kept in sorted(set(self.kept.values()), reverse=True):
                    example = {"ids": tokens.new_zeros(width), "position": tokens.new_zeros(width),
                               "slot": tokens.new_zeros(width), "column": tokens.new_full((width,), self.cache.trash),
                               "place": tokens.new_full((width,), slots * group),
                               "qpos": tokens.new_full((slots, group), -1), "keep": tokens.new_zeros(kept)}
                    self.step(width, group, span, kept, example)
        return len(self.steps)
