"""Verifiers of ``r2r-hf label --verifier NAME[,NAME...]``: which SLM/LLM differences are neutral.

* ``code``: neutral where the difference cannot change the program (comments, docstrings, the prose
  after the code, the same tokens or syntax tree); passes the rest on. Cheap and objective.
* ``llm``: a judge model scores whether the two sentences lead the answer to different places (the
  paper's verifier), with a threshold on its probabilities.
* ``divergent``: calls every mismatch it is asked about divergent; it ends a chain whose earlier
  verifiers only ever call differences neutral (``code,divergent``: the labels before any verifier,
  minus the differences the code verifier shows cannot matter).

Chain them (``code,llm``): each is asked only what the ones before it passed on.
"""

from __future__ import annotations

from .base import Mismatch, Verdict, Verifier
from .code import CodeVerifier
from .divergent import DivergentVerifier
from .judge import JudgeVerifier

KNOWN = ("code", "llm", "divergent")
# The verifiers that need no model: built from their name alone (``llm`` needs the judge).
MODEL_FREE = {"code": CodeVerifier, "divergent": DivergentVerifier}


def parse_chain(names: str | tuple[str, ...] | list[str]) -> tuple[str, ...]:
    """Verifier names from ``"code,llm"`` (or a sequence); an unknown name is one clear error."""
    parts = [n.strip() for n in (names.split(",") if isinstance(names, str) else names) if n.strip()]
    if not parts:
        raise ValueError(f"Name at least one verifier ({', '.join(KNOWN)}), e.g. verifiers= code,llm.")
    for name in parts:
        if name not in KNOWN:
            raise ValueError(f"Unknown verifier {name!r}; choose from {', '.join(KNOWN)} (chain several with commas, "
                             "e.g. verifiers= code,llm; the judge model of 'llm' is judge=).")
    if "divergent" in parts[:-1]:
        raise ValueError("'divergent' decides every mismatch it is asked about: it can only end a chain.")
    if len(set(parts)) != len(parts):
        raise ValueError(f"The verifier chain {','.join(parts)} names a verifier twice.")
    return tuple(parts)


__all__ = ["KNOWN", "MODEL_FREE", "CodeVerifier", "DivergentVerifier", "JudgeVerifier", "Mismatch", "Verdict", "Verifier",
           "parse_chain"]
