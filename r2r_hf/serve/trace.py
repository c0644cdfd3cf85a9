"""A trace of what the decoding thread did, for the cost model's replay (``benchmarks/serving/cost_model.py``).

When ``R2R_SERVE_TRACE`` names a file, the engine appends one JSON line per turn of its loop (when it started
and ended, and the shape of every model forward it ran: model, rows, tokens per row) and one per finished
answer (its prompt length and which of its tokens the LLM wrote). Routing decisions belong to the answer, not
to the schedule (a row answers what it answers alone), so the answers' lines replay under any other policy.
Off unless set: nothing is recorded by default.
"""

from __future__ import annotations

import json
import os
import threading


class Trace:
    """Appends the engine's turns and answers to ``path`` (see the module docstring)."""

    def __init__(self, path: str, counters) -> None:
        self.path, self.counters = path, counters
        counters.shapes = []
        self._lock = threading.Lock()

    @classmethod
    def from_env(cls, counters) -> Trace | None:
        path = os.environ.get("R2R_SERVE_TRACE")
        return cls(path, counters) if path else None

    def _write(self, record: dict) -> None:
        with self._lock, open(self.path, "a", encoding="utf-8") as f:
            f.write(json.dumps(record) + "\n")

    def turn(self, started: float, ended: float, rows: int) -> None:
        shapes, self.counters.shapes = self.counters.shapes, []
        if shapes:
            self._write({"turn": [started, ended], "rows": rows, "forwards": shapes})

    def answer(self, row) -> None:
        self._write({"answer": {"prompt": len(row.owner.prompts[row.index]), "routed": [int(r) for r in row.routed],
                                "finish": row.finish}})
