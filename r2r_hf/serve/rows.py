"""One answer (a row of the batch): its decoding settings, its text so far, when it stops.

Requests in one batch may ask for different sampling settings. Rows with equal settings share one
HF logits-processor list (``RowProcessors`` applies each group to its own rows), every row draws
from its own random stream (``core.sampling.RowSampler``) and routes at its own threshold, so a row
answers what it would answer alone.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import LogitsProcessorList, TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

from ..views.text import IncrementalText


@dataclass(frozen=True)
class Sampling:
    """How one answer is decoded and when it stops.

    Args:
        max_tokens: new tokens at most.
        temperature, top_p, top_k: HF's warpers (temperature 0 or None with ``do_sample`` False: greedy).
        do_sample: draw instead of taking the argmax.
        stops: strings that end the answer (not included in it).
        seed: the row's random stream (None: a fresh one).
        threshold: route where the router's score >= threshold.
        llm_budget: the share of the answer's tokens the LLM may write (None: no budget).
    """

    max_tokens: int
    do_sample: bool
    temperature: float | None
    top_p: float | None
    top_k: int | None
    stops: tuple[str, ...]
    seed: int | None
    threshold: float
    llm_budget: float | None = None

    def warpers_key(self) -> tuple:
        return (self.do_sample, self.temperature, self.top_p, self.top_k) if self.do_sample else (False,)

    def processors(self) -> LogitsProcessorList:
        """HF's sampling warpers for these settings, in the order HF's generate applies them."""
        found = LogitsProcessorList()
        if not self.do_sample:
            return found
        if self.temperature is not None and self.temperature != 1.0:
            found.append(TemperatureLogitsWarper(self.temperature))
        if self.top_k:
            found.append(TopKLogitsWarper(self.top_k))
        if self.top_p is not None and self.top_p < 1.0:
            found.append(TopPLogitsWarper(self.top_p))
        return found


class RowProcessors:
    """HF processors per row group: (ids [B, L], logits [B, V]) -> scores [B, V], as a LogitsProcessorList is."""

    def __init__(self, settings: list[Sampling]) -> None:
        groups: dict[tuple, list[int]] = {}
        for row, s in enumerate(settings):
            groups.setdefault(s.warpers_key(), []).append(row)
        self.groups = [(settings[rows[0]].processors(), rows) for rows in groups.values()]

    def __call__(self, ids: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
        if len(self.groups) == 1:
            return self.groups[0][0](ids, logits)
        out = torch.empty_like(logits)
        for processors, rows in self.groups:
            index = torch.tensor(rows, device=logits.device)
            out[index] = processors(ids[index], logits[index])
        return out


class Row:
    """One answer being written: its text as it grows, what may be sent yet, and why it ended.

    Text that could be the start of a stop string is held back until it is not (or the answer ends).

    Args:
        owner: the request the row answers (``choice`` is its index there).
        sampling: its settings.
        tokenizer: decodes its tokens.
        eos_ids: token ids that end any answer.
        generator: the row's random stream (None when it is greedy).
    """

    def __init__(self, owner, choice: int, sampling: Sampling, tokenizer, eos_ids: set[int],
                 generator: torch.Generator | None = None) -> None:
        self.owner, self.choice, self.sampling, self.eos_ids = owner, choice, sampling, eos_ids
        self.generator = generator
        self.text = IncrementalText(tokenizer)
        self.sent = 0  # characters of text already handed out
        self.generated = self.llm_tokens = 0
        self.finish: str | None = None

    def add(self, token: int, routed: bool) -> str:
        """Take the row's next token; returns the text that may be sent now (possibly empty)."""
        self.generated += 1
        self.llm_tokens += int(routed)
        if token in self.eos_ids:
            self.finish = "stop"
            return self._release(len(self.text.text))
        self.text.add(token)
        full = self.text.text
        stop_at = self._stop_position(full)
        if stop_at is not None:
            self.finish = "stop"
            return self._release(stop_at)
        if self.generated >= self.sampling.max_tokens:
            self.finish = "length"
            return self._release(len(full))
        return self._release(len(full) - self._held(full))

    def _stop_position(self, full: str) -> int | None:
        longest = max((len(s) for s in self.sampling.stops), default=0)
        found = [full.find(s, max(0, self.sent - longest)) for s in self.sampling.stops]
        found = [i for i in found if i >= 0]
        return min(found) if found else None

    def _held(self, full: str) -> int:
        """Characters at the end of ``full`` (not yet sent) that begin some stop string."""
        tail = full[self.sent:]
        return max((n for s in self.sampling.stops for n in range(min(len(s) - 1, len(tail)), 0, -1)
                    if s.startswith(tail[-n:])), default=0)

    def _release(self, upto: int) -> str:
        piece = self.text.text[self.sent : max(upto, self.sent)]
        self.sent = max(upto, self.sent)
        return piece

    def answer_text(self) -> str:
        return self.text.text[: self.sent]
