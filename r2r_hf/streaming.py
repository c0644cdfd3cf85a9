"""A terminal streamer that colours the tokens the LLM wrote.

It is an HF streamer (``put``/``end``) that ``R2RForCausalLM.generate`` also tells, before each
token, which rows were routed (``put_routing``). Plain HF streamers keep working unchanged.
"""

from __future__ import annotations

import sys
from typing import TextIO

import torch

from .visualize import LLM_COLOR, RESET, use_color


class RoutingStreamer:
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
        self.ids: list[int] = []
        self.printed = ""
        self.pending_routed = False
        self.routed: list[bool] = []
        self._prompt_seen = False

    def put_routing(self, routed: torch.Tensor, scores: torch.Tensor) -> None:
        self.routed.append(bool(routed.reshape(-1)[0]))

    def put(self, value: torch.Tensor) -> None:
        if not self._prompt_seen:
            self._prompt_seen = True
            if self.skip_prompt:
                return
            self._write(self.tokenizer.decode(value.reshape(-1).tolist(), skip_special_tokens=True), False)
            return
        if value.dim() > 1 and value.shape[0] > 1 or value.numel() > 1:
            raise ValueError("RoutingStreamer streams one sequence; use batch size 1.")
        self.ids.append(int(value.reshape(-1)[0]))
        self.pending_routed |= bool(self.routed[-1]) if len(self.routed) >= len(self.ids) else False
        text = self.tokenizer.decode(self.ids, skip_special_tokens=True)
        if text.endswith("\ufffd"):
            return  # wait for the token that completes the character
        self._write(text[len(self.printed):], self.pending_routed)
        self.printed = text
        self.pending_routed = False

    def _write(self, text: str, routed: bool) -> None:
        if not text:
            return
        self.stream.write(f"{LLM_COLOR}{text}{RESET}" if routed and self.color else text)
        self.stream.flush()

    def end(self) -> None:
        self.stream.write("\n")
        self.stream.flush()
        self.reset()
