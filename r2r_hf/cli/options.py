"""Argument types shared by every subcommand: each says what it expected in one sentence."""

from __future__ import annotations

import argparse
import math
import os

import torch


def _number(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if math.isnan(value):
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}")
    return value


def fraction(text: str) -> float:
    """A number in [0, 1] (an LLM token rate: 0 routes nothing)."""
    value = _number(text)
    if not 0 <= value <= 1:
        raise argparse.ArgumentTypeError(f"expected a number between 0 and 1, got {text!r}")
    return value


def positive_fraction(text: str) -> float:
    """A number in (0, 1] (a recall target, top-p: 0 would mean nothing at all)."""
    value = _number(text)
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"expected a number in (0, 1] (between 0 and 1, 0 excluded), got {text!r}")
    return value


def non_negative(text: str) -> float:
    """A number >= 0 (a temperature, a threshold)."""
    value = _number(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected a number >= 0, got {text!r}")
    return value


def whole(minimum: int):
    """Whole numbers >= ``minimum`` (1 for counts that must be positive)."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = None
        if value is None or value < minimum:
            raise argparse.ArgumentTypeError(f"expected a whole number >= {minimum}, got {text!r}")
        return value

    parse.__name__ = f"whole number >= {minimum}"
    return parse


positive_int = whole(1)
non_negative_int = whole(0)


def device(allow_auto: bool = False):
    """A torch device (``cpu``, ``cuda``, ``cuda:1``, ``mps``; ``auto`` where allowed) this machine has."""
    names = "cpu, cuda, cuda:N, mps" + (" or auto" if allow_auto else "")

    def parse(text: str) -> str:
        if text == "auto" and allow_auto:
            return text
        try:
            dev = torch.device(text)
        except (RuntimeError, ValueError):
            raise argparse.ArgumentTypeError(f"expected a device ({names}), got {text!r}") from None
        if dev.type == "cuda" and not torch.cuda.is_available():
            raise argparse.ArgumentTypeError(
                f"{text!r} is not available: this torch build has no CUDA support or no GPU is visible; "
                "use --device cpu, or install a CUDA build of torch"
            )
        if dev.type == "cuda" and dev.index is not None and dev.index >= torch.cuda.device_count():
            raise argparse.ArgumentTypeError(
                f"{text!r} is not available: {torch.cuda.device_count()} GPU(s) are visible; pick one of them"
            )
        if dev.type == "mps" and not torch.backends.mps.is_available():
            raise argparse.ArgumentTypeError(f"{text!r} is not available on this machine; use --device cpu")
        return text

    parse.__name__ = "device"
    return parse


def require_dir(path: str, what: str) -> None:
    """Refuse a folder argument that names nothing."""
    if not os.path.isdir(path):
        raise FileNotFoundError(f"The {what} folder {path} does not exist.")
