"""r2r_hf: R2R token-level routing between a small and a large LM, native to Hugging Face transformers.

Importing the package registers ``model_type="r2r"`` with the Auto classes, so
``AutoModelForCausalLM.from_pretrained(router_repo)`` returns an ``R2RForCausalLM``.

Layers (each a subpackage): ``core`` (the decoding loop and its engines), ``model`` (the HF
model, loading, Hub I/O, official routers, the LogitsProcessor form), ``pipeline`` (labeling),
``training`` (training and calibration), ``views`` (HTML, ANSI, streaming), ``serve``, ``cli``.
"""

from __future__ import annotations

import importlib
import os
import sys

from .version import __version__

# Public names and the module that defines each (loaded on first use when the package was imported lazily).
_EXPORTS = {
    "R2RConfig": "config",
    "R2RForCausalLM": "model.modeling",
    "R2RGenerateOutput": "core.outputs",
    "RoutingAwareStreamer": "core.outputs",
    "R2RLogitsProcessor": "model.processor",
    "EntropyRouter": "router",
    "MLPRouter": "router",
    "RandomRouter": "router",
    "Router": "router",
    "build_router": "router",
}
__all__ = sorted([*_EXPORTS, "__version__"])


def _started_as_command() -> bool:
    """Whether this process is the ``r2r-hf`` command (or ``python -m r2r_hf.cli``).

    The command parses its arguments before it imports torch and transformers (``--help`` in well
    under a second) and imports what a subcommand needs when it runs; everything else that imports
    the package gets the Auto registration at import, as documented.
    """
    script = os.path.basename(getattr(sys.modules.get("__main__"), "__file__", None) or "")
    argv = getattr(sys, "orig_argv", [])
    module = argv[argv.index("-m") + 1] if "-m" in argv[:-1] else ""
    return script.startswith("r2r-hf") or module in ("r2r_hf.cli", "r2r_hf.cli.main")


def __getattr__(name: str):
    if name in _EXPORTS:
        value = getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'r2r_hf' has no attribute {name!r}")


if not _started_as_command():
    for _name in _EXPORTS:  # model.modeling registers model_type "r2r" with the Auto classes as it loads
        __getattr__(_name)
