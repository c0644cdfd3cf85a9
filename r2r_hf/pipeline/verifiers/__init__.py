"""Verifiers of ``r2r-hf label --verifier NAME[,NAME...]``: which SLM/LLM differences are neutral.

* ``code``: neutral where the difference cannot change the program (comments, docstrings, the prose
  after the code, the same tokens or syntax tree); passes the rest on. Cheap and objective.
* ``llm``: a judge model scores whether the two sentences lead the answer to different places (the
  paper's verifier), with a threshold on its probabilities.
* ``maths``: in prose (a worked maths answer), neutral where both versions write the same numbers and operators;
  passes the rest on.
* ``logprob``: neutral where the LLM's own log-probability of the SLM's token reaches a threshold (``--logprob-threshold``,
  chosen on hand-checked mismatches); passes the rest on.
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
from .logprob import LogprobVerifier
from .maths import MathsVerifier

KNOWN = ("code", "maths", "logprob", "llm", "divergent")
# The verifiers that need no model, built from the run's label settings (``llm`` needs its judge loaded).
MODEL_FREE = {"code": lambda s: CodeVerifier(), "maths": lambda s: MathsVerifier(),
              "logprob": lambda s: LogprobVerifier(s.logprob_threshold), "divergent": lambda s: DivergentVerifier()}


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


__all__ = ["KNOWN", "MODEL_FREE", "CodeVerifier", "DivergentVerifier", "JudgeVerifier", "LogprobVerifier", "MathsVerifier",
           "Mismatch", "Verdict", "Verifier", "parse_chain"]
