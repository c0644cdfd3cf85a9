"""A request's work as the decoding thread sees it: its answers' prompts and settings, where its events go, and how
it ended.

A request ends once, counted once on ``/metrics`` (``ServeMetrics.request_ended``: the first outcome told stands):
``error`` (the engine failed it), ``cancelled`` (its client went away, or never took its answer: the connection
closed with some of it unsent), or ``completed``: its answer left the server (``listen.Sent``), not merely
decoded. ``Admission`` is one turn's decision of the decoding thread: who joins the batch, who leaves.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from .rows import Choice


class Request:
    """One HTTP request's work: a prompt and a ``Choice`` per row (answer), and where its events go.

    Args:
        prompts: token ids per row.
        choices: what each row asks for (resolved settings and stops).
        emit: called from the engine thread with each event (``engine.py``'s docstring lists them).
    """

    def __init__(self, prompts: list[list[int]], choices: list[Choice], emit: Callable[[tuple], None]) -> None:
        self.prompts, self.choices, self.emit = prompts, choices, emit
        self.cancelled = False
        self.submitted = time.monotonic()
        self.open = len(prompts)  # rows not ended yet
        self.outcome: str | None = None  # how it ended, once counted

    @property
    def rows(self) -> int:
        return len(self.prompts)

    def tell(self, event: tuple) -> None:
        """Hand ``event`` to the request's client; one whose event loop is gone is cancelled (nobody listens)."""
        try:
            self.emit(event)
        except RuntimeError:
            self.cancelled = True


@dataclass
class Admission:
    """One turn's decision: the requests that join, the slots whose rows leave."""

    joining: list[Request] = field(default_factory=list)
    leaving: list[int] = field(default_factory=list)


def fresh_seed() -> int:
    """A seed for a row that named none (its draws are its own, unrepeatable)."""
    return int.from_bytes(os.urandom(8), "little") >> 1
