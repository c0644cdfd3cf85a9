"""What the core learns once about a model (or one of its layers) and keeps beside it, never on it.

The models are the user's HF modules: the core sets no attribute on them (an attribute would travel with a
``copy.deepcopy`` of the module, show in its ``__dict__`` and collide with other libraries'). What it learnt — why a
model cannot use slots or be fused, its compiled regions, a layer's packed weights — lives here, keyed weakly by
the module, and goes when the module goes.
"""

from __future__ import annotations

import logging
import weakref
from typing import Any

from torch import nn

logger = logging.getLogger(__name__)
_NOTES: weakref.WeakKeyDictionary[nn.Module, dict[str, Any]] = weakref.WeakKeyDictionary()


def notes(module: nn.Module) -> dict[str, Any]:
    """The core's notes on ``module``: a dict, empty until something is learnt. A note must not refer back to the
    module (it would keep it alive)."""
    found = _NOTES.get(module)
    if found is None:
        found = _NOTES[module] = {}
    return found


def say_for(module: nn.Module, message: str) -> None:
    """Log ``message`` as a warning the first time it is said of ``module`` (a slower path R2R takes for it)."""
    said = notes(module).setdefault("said", set())
    if message not in said:
        said.add(message)
        logger.warning(message)
