"""The transformers releases r2r_hf supports, and the one place that knows how they differ.

R2R overrides private ``generate`` hooks (``_sample``, ``_prepare_generation_config``,
``_validate_generation_mode``, ``_prepare_cache_for_generation``, ``_get_stopping_criteria``) and
reads private cache internals (a static layer's ``cumulative_length``, a model's
``_get_static_cache_init_shape``). ``tests/test_hf_internals.py`` checks each of them on whichever
release is installed; where releases differ, a shim below says which releases need it.

The range is what CI tests (the newest and the oldest release, each in its own venv from the
wheel). Its upper bound is the next minor release: an untested minor may move a private hook, and
a loud refusal at install time beats routing silently wrong.
"""

from __future__ import annotations

import torch
import transformers
from packaging.version import Version
from transformers import cache_utils

OLDEST = "5.17.0"
NEWEST_TESTED = "5.24.0"
BELOW = "5.25"  # the first release not yet tested (pyproject.toml declares the same range)


def transformers_version() -> Version:
    return Version(transformers.__version__)


def check_transformers() -> None:
    """Raise when the installed transformers is outside the supported range (one sentence)."""
    found = transformers_version()
    if not Version(OLDEST) <= found < Version(BELOW):
        raise ImportError(f"r2r_hf supports transformers {OLDEST} to {NEWEST_TESTED} (below {BELOW}); this environment "
                          f"has {found}. Install a supported release: pip install 'transformers>={OLDEST},<{BELOW}'.")


# ------------------------------------------------------------------ shims, each with the releases that need it
# 5.24 renamed the KV cache argument of every model forward from ``past_key_values`` to ``cache`` (the old name
# is still accepted until 5.40, with a FutureWarning per call site). 5.17-5.23 know only ``past_key_values``.
CACHE_ARGUMENT = "cache" if transformers_version() >= Version("5.24.0.dev0") else "past_key_values"


def cache_argument(cache) -> dict:
    """``{name: cache}`` for a model forward, under the name this release's models take (see ``CACHE_ARGUMENT``)."""
    return {CACHE_ARGUMENT: cache}


def cache_of(kwargs: dict):
    """The KV cache in a model forward's keyword arguments, under either name (a hook sees what generate passed)."""
    return kwargs.get(CACHE_ARGUMENT, kwargs.get("past_key_values"))


# HF's recurrent and convolution cache layers (5.17 may lack the class: then every layer attends)
LINEAR = getattr(cache_utils, "LinearAttentionCacheLayerMixin", ())


def crop_cache(cache, tokens: int) -> None:
    """Drop the last ``tokens`` tokens of an HF cache in place (a rollback). Dynamic layers crop by a negative count
    on every supported release (a windowed layer only where it records its past: ``make_cache``); a static layer
    keeps its memory and moves back its device length (5.17's has no ``crop``), so captured calls over it stay valid,
    and a windowed static layer its host count too (R2R's static caches have none: ``static_cache``). A recurrent or
    convolution layer's state is not cropped: it goes back to a checkpoint (``hold_states``, ``restore_states``); a
    layer that also attends drops its keys and values."""
    if tokens <= 0:
        return
    for layer in cache.layers:
        length = getattr(layer, "cumulative_length", None)
        if isinstance(length, torch.Tensor):
            length.sub_(tokens)
            if isinstance(getattr(layer, "cumulative_length_int", None), int):
                layer.cumulative_length_int -= tokens
        elif not isinstance(layer, LINEAR):
            layer.crop(-tokens)
        elif isinstance(layer, cache_utils.DynamicLayer):  # (its attention half; 5.24's mixed layers)
            next(base for base in type(layer).__mro__ if issubclass(base, cache_utils.DynamicLayer)
                 and not issubclass(base, LINEAR)).crop(layer, -tokens)


def hold_states(cache) -> list:
    """A copy of every recurrent and convolution layer's states in an HF cache (a rollback's checkpoint), with
    whether the layer had read anything (a layer that had not starts from zero again)."""
    held = []
    for layer in cache.layers:
        if not isinstance(layer, LINEAR):
            held.append(None)
            continue
        held.append({"previous": dict(layer.has_previous_state),
                     **{kind: {i: None if s is None else s.clone() for i, s in getattr(layer, kind).items()}
                        for kind in ("conv_states", "recurrent_states")}})
    return held


def restore_states(cache, held: list) -> None:
    """Every recurrent and convolution layer of ``cache`` back to ``held`` (``hold_states``), in place (a static
    cache's states keep their memory)."""
    for layer, states in zip(cache.layers, held):
        if states is None:
            continue
        for kind in ("conv_states", "recurrent_states"):
            for i, saved in states[kind].items():
                current = getattr(layer, kind)[i]
                if saved is None and current is not None:
                    current.zero_()
                elif saved is not None:
                    current.copy_(saved)
        layer.has_previous_state.update(states["previous"])
