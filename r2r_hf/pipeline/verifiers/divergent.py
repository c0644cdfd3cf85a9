"""The ``divergent`` verifier: it ends a chain whose earlier verifiers only call differences neutral
(``code,divergent``: every difference the code verifier cannot show harmless is divergent)."""

from __future__ import annotations

from ..classes import Decision
from .base import Mismatch, Verdict


class DivergentVerifier:
    """Every mismatch it is asked about is divergent (see the module docstring)."""

    name = "divergent"

    def key(self) -> str:
        return "divergent"

    def settings(self) -> dict:
        return {"name": self.name}

    def decide(self, stored: dict) -> Decision:
        return Decision(stored["verdict"])

    def judge(self, items: list[Mismatch]) -> list[Verdict]:
        return [Verdict(Decision.DIVERGENT, "a difference no earlier verifier called neutral") for _ in items]
