"""The R2R labeling pipeline: which SLM/LLM differences change the reasoning.

Steps (each resumable, shard by shard; declared in ``steps.py``): 0 ``responses`` (LLM reference answers),
1 ``features`` (SLM prefill: the router's inputs per answer token), 2 ``continuations``
(LLM continues each mismatch to its sentence end), 3 ``verdicts`` (a chain of verifiers judges
neutral or divergent; ``verifiers/``), 4 ``labels`` (one label set per chain, with its summary).

The names load on first use, so ``pipeline.settings`` and ``pipeline.steps`` are read (by the CLI) without
importing torch.
"""

import importlib

_EXPORTS = {"LabelData": "dataset", "load_labels": "dataset", "Prompt": "prompts", "read_prompts": "prompts",
            "LabelSettings": "settings", "label": "runner"}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
