"""The ``code`` verifier: a difference is neutral when it cannot change the program.

The program is the answer's first fenced code block (what an evaluation runs; an answer with no
fence is all code if it parses as Python). An answer that is no program (a worked maths answer in words) is passed on
whole: its differences are prose. A mismatch is judged neutral when

* it lies after that block closed (the prose around the code, further examples): the program is written;
* it lies inside a comment, and neither model's token ends the comment line;
* it lies inside a string that is a statement of its own (a docstring), and neither token closes it;
* the completed statement is the same program text on both sides: the same Python tokens once
  whitespace, comments and quote style are ignored, or the same syntax tree where both sides parse.

Everything else (prose before the code, a real code difference, a string the code uses) is passed
on to the next verifier: this one never calls a difference divergent.
"""

from __future__ import annotations

import ast
import io
import re
import tokenize
import warnings
from typing import Any

from ..classes import Decision
from .base import Mismatch, Verdict

_FENCE = re.compile(r"^[ \t]*```", re.M)
_STRING_PREFIX = re.compile(r"^[rRbBuU]{0,2}$")
VERSION = 4  # bump when a rule changes: stored verdicts of an older version are not reused (4: prose answers)


def program_region(response: str, prefix: str) -> tuple[str, str]:
    """Where the text after ``prefix`` falls: ("before" | "code" | "after", the code written so far)."""
    fences = [m.start() for m in _FENCE.finditer(response)]
    at = len(prefix)
    if not fences:
        return "code", prefix
    opening = fences[0]
    if at <= opening:
        return "before", ""
    body = response.index("\n", opening) + 1 if "\n" in response[opening:] else len(response)
    if at < body:
        return "before", ""  # on the fence line itself (its language tag)
    closing = next((f for f in fences[1:] if f >= body), None)
    if closing is not None and at > closing:
        return "after", ""
    return "code", prefix[body:]


def looks_like_code(response: str) -> bool:
    """Whether an answer is a program: it holds a fenced block, or it parses as Python as a whole."""
    if _FENCE.search(response):
        return True
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", SyntaxWarning)
        try:
            ast.parse(response)
        except (SyntaxError, ValueError):
            return False
    return True


def _tokens(code: str) -> tuple[list[tuple[int, str]], str | None, tuple[int, int] | None]:
    """The Python tokens of ``code`` as far as they go, why tokenizing stopped early, and where."""
    out: list[tuple[int, str]] = []
    try:
        for tok in tokenize.generate_tokens(io.StringIO(code).readline):
            out.append((tok.type, tok.string))
    except tokenize.TokenError as err:
        return out, str(err.args[0]), err.args[1]
    except (IndentationError, SyntaxError) as err:
        return out, str(err), None
    return out, None, None


def _normal(tokens: list[tuple[int, str]]) -> list[tuple[int, Any]]:
    """Tokens with whitespace-only, comment and layout tokens dropped, and literals by value."""
    kept = []
    for kind, text in tokens:
        if kind in (tokenize.COMMENT, tokenize.NL, tokenize.ENCODING, tokenize.ENDMARKER):
            continue
        if kind == tokenize.NEWLINE:
            text = "\n"
        elif kind in (tokenize.STRING, tokenize.NUMBER):
            try:
                text = repr(ast.literal_eval(text))
            except (ValueError, SyntaxError):
                pass
        kept.append((kind, text))
    while kept and kept[-1][0] in (tokenize.NEWLINE, tokenize.DEDENT):  # where a side stops is not a difference
        kept.pop()
    return kept


def _same_tree(a: str, b: str) -> bool:
    try:
        return ast.dump(ast.parse(a)) == ast.dump(ast.parse(b))
    except (SyntaxError, ValueError):
        return False


def inside(code: str) -> str | None:
    """What the end of ``code`` lies inside: "comment", "bare string" (a docstring), "string", or None."""
    tokens, error, where = _tokens(code)
    if error is not None and "multi-line string" in error and where is not None:
        line = code.splitlines()[where[0] - 1] if code.splitlines() else ""
        before = line[: where[1]].strip()
        return "bare string" if _STRING_PREFIX.match(before) else "string"
    last_line = code.rsplit("\n", 1)[-1]
    if error is None:
        real = [t for t in tokens if t[0] not in (tokenize.NL, tokenize.NEWLINE, tokenize.ENDMARKER,
                                                  tokenize.DEDENT, tokenize.INDENT)]
        # The comment must be on the line being written, not end the line before it.
        if real and real[-1][0] == tokenize.COMMENT and real[-1][1].strip() in last_line:
            return "comment"
    if last_line.count('"') % 2 or last_line.count("'") % 2:
        return "string"
    return None


class CodeVerifier:
    """Neutral where the difference cannot change the program; passes the rest on (see the module docstring)."""

    name = "code"

    def key(self) -> str:
        return f"code-v{VERSION}"

    def settings(self) -> dict[str, Any]:
        return {"name": self.name, "version": VERSION}

    def decide(self, stored: dict[str, Any]) -> Decision | None:
        return None if stored["verdict"] is None else Decision(stored["verdict"])

    def judge(self, items: list[Mismatch]) -> list[Verdict]:
        with warnings.catch_warnings():  # parsing half-written code warns about odd literals; only the result counts
            warnings.simplefilter("ignore", SyntaxWarning)
            return [self.judge_one(item) for item in items]

    def judge_one(self, m: Mismatch) -> Verdict:
        if not looks_like_code(m.response):
            return Verdict(None, "not a program")
        region, code = program_region(m.response, m.prefix)
        if region == "after":
            return Verdict(Decision.NEUTRAL, "after the program")
        if region == "before":
            return Verdict(None, "before the program")
        where = inside(code)
        ends_line = "\n" in m.slm_token or "\n" in m.llm_token
        closes = any(q in m.slm_token or q in m.llm_token for q in ('"""', "'''"))
        if where == "comment" and not ends_line:
            return Verdict(Decision.NEUTRAL, "in a comment")
        if where == "bare string" and not closes:
            return Verdict(Decision.NEUTRAL, "in a docstring")
        slm_code, llm_code = code + m.slm, code + m.llm
        if _normal(_tokens(slm_code)[0]) == _normal(_tokens(llm_code)[0]):
            return Verdict(Decision.NEUTRAL, "same tokens")
        if _same_tree(slm_code, llm_code):
            return Verdict(Decision.NEUTRAL, "same syntax tree")
        if where == "bare string":
            return Verdict(None, "closes a docstring")
        return Verdict(None, "in a string the code uses" if where == "string" else "the code differs")
