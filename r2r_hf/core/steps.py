"""A generate call's committed tokens in HF's left-padded rectangle, and the KV caches HF would use.

``Committed`` holds the tokens written so far in buffers allocated once per call (``layouts.RectangleLayout``
decodes over it). The model calls themselves (SLM step, router, LLM catch-up) live in ``engines.py``:
eager, compiled or captured, with the same signatures. How a token is chosen is ``choice.py``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from transformers.cache_utils import Cache, DynamicCache, StaticCache

# HF's LogitsProcessorList, or any callable of the same shape: (ids [B, L], logits [B, V]) -> scores [B, V].
Processors = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass
class Committed:
    """The committed sequence of a batch, in buffers of a fixed ``capacity`` allocated once per call.

    Args:
        ids: [B, capacity] token ids; only the first ``length`` columns are written.
        mask: [B, capacity] 1 for real tokens, 0 for left padding (ones past the prompt).
        positions: [B, capacity] position ids, continuing from each row's last prompt position.
        length: columns committed so far.
        padded: whether any prompt row is padded; when not, eager forwards pass no mask (as HF does).
    """

    ids: torch.Tensor
    mask: torch.Tensor
    positions: torch.Tensor
    length: int
    padded: bool

    @classmethod
    def from_prompt(
        cls, input_ids: torch.Tensor, mask: torch.Tensor | None, positions: torch.Tensor | None, capacity: int
    ) -> Committed:
        """Buffers of width ``capacity`` holding the prompt (``mask``/``positions`` as HF prepared them)."""
        batch, prompt = input_ids.shape
        ids = input_ids.new_zeros(batch, capacity)
        ids[:, :prompt] = input_ids
        if positions is None:
            positions = torch.arange(prompt, device=input_ids.device).expand(batch, prompt)
        pos = input_ids.new_zeros(batch, capacity)
        pos[:, :prompt] = positions
        pos[:, prompt:] = positions[:, -1:] + torch.arange(1, capacity - prompt + 1, device=input_ids.device)
        full_mask = input_ids.new_ones(batch, capacity)
        if mask is not None:
            full_mask[:, :prompt] = mask
        return cls(ids, full_mask, pos, prompt, padded=mask is not None)

    def view(self) -> torch.Tensor:
        """[B, length]: the committed ids."""
        return self.ids[:, : self.length]

    def mask_upto(self, end: int) -> torch.Tensor | None:
        """The mask over the first ``end`` columns, or None when nothing is padded."""
        return self.mask[:, :end] if self.padded else None

    def append(self, token: torch.Tensor) -> None:
        self.ids[:, self.length] = token
        self.length += 1


def make_cache(model: torch.nn.Module, implementation: str | None, length: int) -> Cache:
    """A fresh KV cache for one model; R2R never crops, so a static cache is always allowed."""
    if implementation == "static":
        return StaticCache(config=model.config, max_cache_len=length)
    return DynamicCache(config=model.config)
