"""The ``maths`` verifier: in prose (a worked maths answer, or the words around a program), a difference is neutral
where both versions carry the same numbers and operators in the same order: only the words differ.

It compares what each side writes from the differing token to its sentence's end (``Mismatch.slm`` and ``.llm``):
the numbers (thousands separators, currency signs and a trailing ``.0`` ignored) and the arithmetic and comparison
operators (``×``/``x`` between numbers as ``*``, ``÷`` as ``/``), in order. At least one number must be there: a
sentence of words alone tells it nothing. Inside a program (the code verifier's region) it passes everything on, as
it does any other difference: it never calls a difference divergent.
"""

from __future__ import annotations

import re
from typing import Any

from ..classes import Decision
from .base import Mismatch, Verdict
from .code import looks_like_code, program_region

VERSION = 1
_TOKEN = re.compile(r"(?<![\w.])\d[\d,]*(?:\.\d+)?|[-+*/=<>%^]")
_TIMES = re.compile(r"(?<=\d)\s*[x×]\s*(?=\d)")  # 3 x 4, 3×4: a product


def arithmetic(text: str) -> list[str]:
    """The numbers and operators of ``text``, in order, each in one spelling."""
    out = []
    for token in _TOKEN.findall(_TIMES.sub(" * ", text).replace("÷", "/").replace("$", "")):
        value = token.replace(",", "")
        out.append(value[:-2] if value.endswith(".0") else value)
    return out


def in_prose(m: Mismatch) -> bool:
    """Whether the difference lies in prose: an answer that is no program, or outside its program's code block."""
    if not looks_like_code(m.response):
        return True
    return program_region(m.response, m.prefix)[0] != "code"


class MathsVerifier:
    """Neutral where, in prose, both sides write the same numbers and operators; passes the rest on."""

    name = "maths"

    def key(self) -> str:
        return f"maths-v{VERSION}"

    def settings(self) -> dict[str, Any]:
        return {"name": self.name, "version": VERSION}

    def decide(self, stored: dict[str, Any]) -> Decision | None:
        return None if stored["verdict"] is None else Decision(stored["verdict"])

    def judge(self, items: list[Mismatch]) -> list[Verdict]:
        return [self.judge_one(m) for m in items]

    def judge_one(self, m: Mismatch) -> Verdict:
        if not in_prose(m):
            return Verdict(None, "inside the program")
        slm, llm = arithmetic(m.slm), arithmetic(m.llm)
        if not any(t[0].isdigit() for t in slm + llm):
            return Verdict(None, "no numbers")
        if slm == llm:
            return Verdict(Decision.NEUTRAL, "same numbers and operators")
        return Verdict(None, "the numbers or operators differ")
