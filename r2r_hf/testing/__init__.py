"""Test helpers that ship with the package (examples, dry runs and users' own tests use them too).

* ``models``: tiny random SLM/LLM pairs sharing a small tokenizer, and a tiny verifier;
* ``graphs``: CUDA-graph capture emulated on the CPU, as strict as the real thing;
* ``server``: ``r2r-hf serve`` as a process of its own, started once ``/health`` answers and stopped by SIGTERM;
* ``families``, ``pairs``, ``matrix``, ``table``: tiny pairs of every decoder family, each path checked against the
  models' own ``generate`` (tests/test_model_families.py), and docs/model_families.md generated from it.
"""

from .models import (
    CHAT_TEMPLATE,
    EOS_ID,
    PAD_ID,
    WORDS,
    make_related_llm,
    make_tiny_llm,
    make_tiny_slm,
    make_tiny_verifier,
    make_tokenizer,
    save_tiny_pair,
    save_tiny_verifier,
)

__all__ = ["CHAT_TEMPLATE", "EOS_ID", "PAD_ID", "WORDS", "make_related_llm", "make_tiny_llm", "make_tiny_slm",
           "make_tiny_verifier", "make_tokenizer", "save_tiny_pair", "save_tiny_verifier"]
