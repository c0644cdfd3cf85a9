"""The label classes, declared once: what a verifier decides, and the label each answer token gets.

A verifier decides a mismatch ``Decision.NEUTRAL`` or ``Decision.DIVERGENT`` (or cannot tell: None). The
labels step turns that into a ``Label`` per answer token: ``IDENTICAL`` where the SLM's proposal is the LLM's
token, ``NEUTRAL``/``DIVERGENT`` at a decided mismatch, ``EXCLUDED`` where no verifier of the chain decided.
The router learns ``label == DIVERGENT``; excluded rows are never trained on. The values are on disk.
"""

from __future__ import annotations

import enum


class Decision(enum.IntEnum):
    """A verifier's verdict on one mismatch (stored verdicts decode to these)."""

    NEUTRAL = 0
    DIVERGENT = 1


class Label(enum.IntEnum):
    """One answer token's class in a label set (int8 on disk)."""

    IDENTICAL = 0
    NEUTRAL = 1
    DIVERGENT = 2
    EXCLUDED = -1

    @property
    def title(self) -> str:
        """Its name in summaries and records: ``identical``, ``neutral``, ``divergent``, ``excluded``."""
        return self.name.lower()

    @classmethod
    def of(cls, decision: int | None) -> Label:
        """The label of a mismatch a chain decided so (None: undecided)."""
        return cls.EXCLUDED if decision is None else cls.NEUTRAL if decision == Decision.NEUTRAL else cls.DIVERGENT


TRAINED = (Label.IDENTICAL, Label.NEUTRAL, Label.DIVERGENT)  # the classes a router is trained on
