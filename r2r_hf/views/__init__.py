"""Seeing the routing: a standalone HTML page, ANSI colours, and a colouring streamer.

    out = model.generate(**inputs, return_dict_in_generate=True)
    Path("r2r.html").write_text(to_html(out, tok))
    print(to_ansi(out, tok))
    model.generate(**inputs, streamer=RoutingStreamer(tok))
"""

from .html import LLM_COLOR, routed_texts, to_ansi, to_html, use_color
from .streaming import RoutingStreamer
from .text import IncrementalText

__all__ = ["LLM_COLOR", "IncrementalText", "RoutingStreamer", "routed_texts", "to_ansi", "to_html", "use_color"]
