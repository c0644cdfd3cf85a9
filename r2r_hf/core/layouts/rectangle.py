"""A generate call's committed tokens in HF's left-padded rectangle, and the KV caches HF would use.

``Committed`` holds the tokens written so far in buffers allocated once per call (``layouts.RectangleLayout``
decodes over it). The model calls themselves (SLM step, router, LLM catch-up) live in ``engines.py``:
eager, compiled or captured, with the same signatures. How a token is chosen is ``choice.py``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from transformers.cache_utils import Cache, DynamicCache, StaticCache

from ..counters import Counters

if TYPE_CHECKING:  # model_calls reads these buffers: only the type goes the other way
    from .model_calls import Steps


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


class RectangleLayout:
    """HF's left-padded rectangle: every row commits at every step (see the module docstring).

    Args:
        steps: the model calls over HF caches (``Routing.steps``).
        seq: the committed buffers, holding the prompt.
        counters: where forwards are counted.
    """

    def __init__(self, steps: Steps, seq: Committed, counters: Counters) -> None:
        self.steps, self.seq, self.counters = steps, seq, counters
        self.slm_seen = 0  # columns the SLM has read
        self.llm_seen = 0  # columns the LLM has read (one lag: it reads every row to the end)
        self.rows = seq.ids.shape[0]

    def lengths(self) -> list[int]:
        return [self.seq.length] * self.rows

    def processor_ids(self, rows: list[int] | None = None) -> torch.Tensor:
        """What HF's processors see: the whole rectangle (left padding included, as in HF ``generate``)."""
        return self.seq.view()

    def append(self, rows: list[int], token: torch.Tensor) -> None:
        if len(rows) != self.rows:
            raise ValueError("every row of a rectangle commits a token at every step")
        self.seq.append(token)

    def slm_read(self, rows: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        start, self.slm_seen = self.slm_seen, self.seq.length
        self.counters.forward("slm", self.rows, self.seq.length - start)
        return self.steps.slm_read(self.seq, start)

    def llm_read(self, rows: list[int]) -> torch.Tensor:
        """Every row's logits [B, V] (the rectangle catches every row up; ``rows`` are the ones that need them)."""
        self.counters.forward("llm", self.rows, self.seq.length - self.llm_seen)
        logits = self.steps.llm_read(self.seq, self.llm_seen)
        self.llm_seen = self.seq.length
        return logits

    def route(self, logits: torch.Tensor, hidden: torch.Tensor, token: torch.Tensor) -> torch.Tensor:
        return self.steps.route_scores(logits, hidden, token)

    def close(self) -> None:
        self.steps.close()
