"""The ``logprob`` verifier: a difference is neutral where the LLM itself finds the SLM's token likely.

At every mismatch the labeling run records the LLM's log-probability of the SLM's token there (``Mismatch.llm_logprob``,
read off the LLM's own step: no extra model call). Where it reaches the threshold, the LLM would plausibly have
written that token itself, and the difference is called neutral; below it the mismatch is passed on. On the 90
hand-checked mismatches of the first labeling run this signal ranked neutral above divergent with ROC AUC 0.70,
where the 1.5B judge ranked them below chance; choose the threshold on hand-checked mismatches
(``benchmarks/router/calibrate_verifiers.py``). Its scores are kept, so another threshold reuses them.
"""

from __future__ import annotations

from typing import Any

from ..classes import Decision
from .base import Mismatch, Verdict

VERSION = 1
DEFAULT_THRESHOLD = -1.0  # log-probability (natural log): the SLM's token has at least ~37 % of the LLM's belief


class LogprobVerifier:
    """Neutral where the LLM's log-probability of the SLM's token is at least ``threshold``; passes the rest on.

    Args:
        threshold: a natural-log probability, at most 0.
    """

    name = "logprob"

    def __init__(self, threshold: float = DEFAULT_THRESHOLD) -> None:
        if not threshold <= 0:
            raise ValueError(f"The logprob verifier's threshold is a log-probability, at most 0; got {threshold}.")
        self.threshold = float(threshold)

    def key(self) -> str:
        """Its scores are the run's own log-probabilities: kept per version, reused by any threshold."""
        return f"logprob-v{VERSION}"

    def settings(self) -> dict[str, Any]:
        return {"name": self.name, "version": VERSION, "threshold": self.threshold}

    def decide(self, stored: dict[str, Any]) -> Decision | None:
        return Decision.NEUTRAL if stored["score"] >= self.threshold else None

    def judge(self, items: list[Mismatch]) -> list[Verdict]:
        out = []
        for m in items:
            if m.llm_logprob is None:
                raise ValueError("This run's continuations record no log-probabilities (labelled before they were); "
                                 "label its continuations again (delete continuations/ and rerun the step) to use "
                                 "the logprob verifier.")
            neutral = m.llm_logprob >= self.threshold
            out.append(Verdict(Decision.NEUTRAL if neutral else None, "the LLM finds the SLM's token likely" if neutral
                               else "the LLM finds the SLM's token unlikely", round(m.llm_logprob, 4)))
        return out
