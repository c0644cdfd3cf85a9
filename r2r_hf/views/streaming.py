"""A terminal streamer that colours the tokens the LLM wrote.

It is an HF streamer (``put``/``end``) and a ``RoutingAwareStreamer``: ``generate`` tells it,
before each token, which rows were routed (``put_routing``). Plain HF streamers keep working unchanged.
"""

from __future__ import annotations

import sys
from typing import TextIO

import torch

from ..core.outputs import RoutingAwareStreamer
from .html import LLM_COLOR, RESET, use_color
from .text import IncrementalText


class RoutingStreamer(RoutingAwareStreamer):
    """Prints generated text as it is produced; LLM-written tokens in colour (batch 1).

    Args:
        tokenizer: decodes the tokens.
        stream: where to write (default stdout).
        color: force colour on/off (default: on for terminals without ``NO_COLOR``).
        skip_prompt: do not print the prompt.
    """

    def __init__(self, tokenizer, stream: TextIO | None = None, color: bool | None = None, skip_prompt: bool = True):
        self.tokenizer = tokenizer
        self.stream = stream or sys.stdout
        self.color = use_color(self.stream) if color is None else color
        self.skip_prompt = skip_prompt
        self.reset()

    def reset(self) -> None:
        self.text = IncrementalText(self.tokenizer)
        self.pending_routed = False  # a routed token inside a character colours the whole character
        self.next_routed = False
        self._prompt_seen = False

    def put_routing(self, routed: torch.Tensor, scores: torch.Tensor) -> None:
        self.next_routed = bool(routed.reshape(-1)[0])

    def put(self, value: torch.Tensor) -> None:
        if not self._prompt_seen:
            self._prompt_seen = True
            if not self.skip_prompt:
                self._write(self.tokenizer.decode(value.reshape(-1).tolist(), skip_special_tokens=True), False)
            return
        if value.numel() > 1:
            raise ValueError("RoutingStreamer streams one sequence; use batch size 1.")
        self.pending_routed |= self.next_routed
        self.next_routed = False
        piece = self.text.add(int(value.reshape(-1)[0]))
        if piece is None:
            return  # wait for the token that completes the character
        self._write(piece, self.pending_routed)
        self.pending_routed = False

    def _write(self, text: str, routed: bool) -> None:
        if not text:
            return
        self.stream.write(f"{LLM_COLOR}{text}{RESET}" if routed and self.color else text)
        self.stream.flush()

    def end(self) -> None:
        self._write(self.text.end(), self.pending_routed)  # what was held back (an unfinished character...)
        self.stream.write("\n")
        self.stream.flush()
        self.reset()
