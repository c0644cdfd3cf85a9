"""What every verifier sees and says, and how a chain of verifiers decides a label.

A verifier judges mismatches: places where the SLM's token differs from the LLM's. For each it
says neutral (0: the answer goes the same way), divergent (1: it goes elsewhere), or passes it on
(None: it cannot tell) to the next verifier of the chain. The first verifier that decides, decides.
Mismatches whose two sentences are the same text are neutral without asking anyone; a mismatch
no verifier decides is excluded from training (and counted).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, Protocol

from ..classes import Decision


@dataclass(frozen=True)
class Mismatch:
    """One place where the SLM's token differs from the LLM's, as text.

    Args:
        index: position in the shard's list of mismatches.
        prompt: the prompt as the models read it.
        prefix: the LLM's answer before the differing token.
        slm_token, llm_token: the text of the SLM's and of the LLM's token there.
        slm: the SLM's token and what the LLM wrote after it, to the end of the sentence.
        llm: the LLM's own token and answer, to the end of the sentence.
        context: the preceding sentences a judge sees (the end of ``prefix``, cut to a token budget).
        slm_sentence, llm_sentence: the two versions of the sentence, the differing token marked ``<<...>>``.
        response: the LLM's whole answer (for verifiers that look past the sentence).
        llm_logprob, llm_own_logprob: the LLM's log-probability there of the SLM's token and of its own (None in
            runs labelled before they were recorded).
    """

    index: int
    prompt: str
    prefix: str
    slm_token: str
    llm_token: str
    slm: str
    llm: str
    context: str
    slm_sentence: str
    llm_sentence: str
    response: str
    llm_logprob: float | None = None
    llm_own_logprob: float | None = None


@dataclass
class Verdict:
    """One verifier's answer on one mismatch: a ``Decision`` (0 neutral, 1 divergent), or None: passed on; ``score`` where it has one."""

    verdict: Decision | None
    why: str = ""
    score: float | None = None

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


class Verifier(Protocol):
    """A verifier of a labeling chain (``LabelSettings.verifiers``); the known ones are in ``verifiers/__init__.py``."""

    name: str

    def key(self) -> str:
        """Names its verdicts on disk: changes whenever its verdicts could (model, prompt, version)."""
        ...

    def settings(self) -> dict[str, Any]:
        """What decides its verdicts, recorded with every label set that uses it."""
        ...

    def judge(self, items: list[Mismatch]) -> list[Verdict]:
        """Verdicts for ``items``, in order."""
        ...

    def decide(self, stored: dict[str, Any]) -> Decision | None:
        """The decision from a stored verdict (a scoring verifier applies its threshold here)."""
        ...
