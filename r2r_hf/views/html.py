"""Seeing the routing: which tokens the LLM wrote, as a standalone HTML page or ANSI colours.

    out = model.generate(**inputs, return_dict_in_generate=True)
    Path("r2r.html").write_text(to_html(out, tok))
    print(to_ansi(out, tok))
"""

from __future__ import annotations

import html
import os
from dataclasses import dataclass

from .text import IncrementalText

LLM_COLOR = "\033[1;38;5;208m"  # bold orange
RESET = "\033[0m"


@dataclass
class Piece:
    """One generated token's text and how it was written."""

    text: str
    routed: bool
    score: float


def token_pieces(tokenizer, ids: list[int], routed: list[bool], scores: list[float]) -> list[Piece]:
    """One piece of text per token (see ``IncrementalText``); a token inside a character gets "" (the last token
    takes what is still held back at the end: ``IncrementalText.end``)."""
    text = IncrementalText(tokenizer, skip_special_tokens=False)
    pieces = [Piece(text.add(token) or "", r, s) for token, r, s in zip(ids, routed, scores)]
    if pieces:
        pieces[-1].text += text.end()
    return pieces


def _rows(output, tokenizer, prompt_length: int | None):
    sequences = output.sequences
    new = output.routed.shape[1]
    start = sequences.shape[1] - new if prompt_length is None else prompt_length
    for row in range(sequences.shape[0]):
        keep = output.generated_mask[row].tolist()
        ids = [t for t, k in zip(sequences[row, start:].tolist(), keep) if k]
        routed = [r for r, k in zip(output.routed[row].tolist(), keep) if k]
        scores = [float(s) for s, k in zip(output.router_scores[row].tolist(), keep) if k]
        prompt = tokenizer.decode(sequences[row, :start], skip_special_tokens=True)
        yield prompt, token_pieces(tokenizer, ids, routed, scores)


def use_color(stream=None) -> bool:
    """Colour only on a terminal, and never when ``NO_COLOR`` is set."""
    import sys

    stream = stream or sys.stdout
    return "NO_COLOR" not in os.environ and hasattr(stream, "isatty") and stream.isatty()


def to_ansi(output, tokenizer, row: int = 0, color: bool = True) -> str:
    """The generated text of one row with LLM-written tokens in bold orange.

    Args:
        output: an ``R2RGenerateOutput`` (``return_dict_in_generate=True``).
        tokenizer: the pair's tokenizer.
        row: which batch row.
        color: False returns plain text.
    """
    _, pieces = list(_rows(output, tokenizer, None))[row]
    if not color:
        return "".join(p.text for p in pieces)
    return "".join(f"{LLM_COLOR}{p.text}{RESET}" if p.routed and p.text else p.text for p in pieces)


_STYLE = """
body { font-family: system-ui, sans-serif; margin: 2rem auto; max-width: 60rem; color: #1d1d1f; }
h1 { font-size: 1.3rem; } .meta { color: #666; font-size: .9rem; }
.bar { display: flex; height: .8rem; border-radius: .4rem; overflow: hidden; margin: .4rem 0 1rem; }
.bar .s { background: #cfe3ff; } .bar .l { background: #ff9e4a; }
.prompt { color: #777; white-space: pre-wrap; border-left: 3px solid #ddd; padding-left: .8rem; }
.answer { white-space: pre-wrap; font-family: ui-monospace, monospace; font-size: .92rem; line-height: 1.5;
          background: #fafafa; padding: 1rem; border-radius: .5rem; }
.tok.slm { background: transparent; } .tok.llm { background: #ffb873; border-radius: .2rem; }
.legend span { padding: 0 .4rem; border-radius: .2rem; margin-right: .6rem; }
"""


def to_html(output, tokenizer, title: str = "R2R routing", prompt_length: int | None = None) -> str:
    """A standalone HTML page (no external assets) showing every generated token.

    LLM-written tokens are highlighted; hovering a token shows its router score; a summary bar
    shows the counts and the LLM token rate. Each batch row gets its own section.

    Args:
        output: an ``R2RGenerateOutput`` (``return_dict_in_generate=True``).
        tokenizer: the pair's tokenizer.
        title: page title.
        prompt_length: where generation started (default: inferred from the output).
    """
    sections = []
    for index, (prompt, pieces) in enumerate(_rows(output, tokenizer, prompt_length)):
        n = len(pieces)
        llm = sum(p.routed for p in pieces)
        rate = llm / n if n else 0.0
        spans = "".join(
            f'<span class="tok {"llm" if p.routed else "slm"}" data-routed="{int(p.routed)}" '
            f'title="router score {p.score:.3f}">{html.escape(p.text)}</span>'
            for p in pieces
        )
        sections.append(
            f'<section id="row-{index}"><p class="meta">{n} generated tokens: {n - llm} by the SLM, {llm} by the LLM '
            f'(LLM token rate <b class="rate">{rate:.1%}</b>)</p>'
            f'<div class="bar"><div class="s" style="flex:{n - llm}"></div><div class="l" style="flex:{llm}"></div></div>'
            f'<div class="prompt">{html.escape(prompt)}</div><div class="answer">{spans}</div></section>'
        )
    threshold = getattr(output, "threshold", None)
    legend = ('<p class="legend"><span style="background:#fafafa">SLM token</span>'
              '<span style="background:#ffb873">LLM token</span> hover a token for its router score'
              + (f"; threshold {threshold:.3g}" if threshold is not None and threshold != float("inf") else "")
              + "</p>")
    return (f"<!DOCTYPE html><html><head><meta charset=\"utf-8\"><title>{html.escape(title)}</title>"
            f"<style>{_STYLE}</style></head><body><h1>{html.escape(title)}</h1>{legend}{''.join(sections)}</body></html>")


def routed_texts(output, tokenizer, row: int = 0) -> list[str]:
    """Texts of the LLM-written tokens of one row, in order (what the HTML highlights)."""
    _, pieces = list(_rows(output, tokenizer, None))[row]
    return [p.text for p in pieces if p.routed]
