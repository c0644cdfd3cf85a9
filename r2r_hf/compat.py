"""The transformers releases r2r_hf supports, and the one place that knows how they differ.

R2R overrides private ``generate`` hooks (``_sample``, ``_prepare_generation_config``,
``_validate_generation_mode``, ``_prepare_cache_for_generation``, ``_get_stopping_criteria``) and
reads private cache internals (a static layer's ``cumulative_length``, a model's
``_get_static_cache_init_shape``). ``tests/test_hf_internals.py`` checks each of them on whichever
release is installed; where releases differ, a shim below says which releases need it.

The range is what CI tests (the newest and the oldest release, each in its own venv from the
wheel). Its upper bound is the next minor release: an untested minor may move a private hook, and
a loud refusal at install time beats routing silently wrong. Where a user forces another release
past pip, R2R says so once, as it loads a pair (``warn_if_untested``).
"""

from __future__ import annotations

import functools
import inspect
import logging

import torch
import transformers
from packaging.version import Version
from transformers import cache_utils

OLDEST = "5.17.0"
NEWEST_TESTED = "5.25.0"
BELOW = "5.26"  # the first release not yet tested (pyproject.toml declares the same range)

logger = logging.getLogger(__name__)
_warned: set[str] = set()


def transformers_version() -> Version:
    return Version(transformers.__version__)


def untested_sentence(found: Version) -> str | None:
    """What R2R says of a transformers release outside the tested range, or None inside it."""
    if Version(OLDEST) <= found < Version(BELOW):
        return None
    return (f"transformers {found} is outside the releases r2r_hf is tested with ({OLDEST} to {NEWEST_TESTED}): it "
            "may route wrongly where a private hook moved; install a tested one: "
            f"pip install 'transformers>={OLDEST},<{BELOW}'.")


def warn_if_untested() -> None:
    """Warn once per process where the installed transformers is outside the tested range (pip keeps users inside
    it; a forced install gets this sentence as a pair loads, never a silent difference)."""
    sentence = untested_sentence(transformers_version())
    if sentence is not None and sentence not in _warned:
        _warned.add(sentence)
        logger.warning(sentence)


def check_transformers() -> None:
    """Raise when the installed transformers is outside the supported range (one sentence)."""
    sentence = untested_sentence(transformers_version())
    if sentence is not None:
        raise ImportError(sentence)


# ------------------------------------------------------------------ shims, each with the releases that need it
# 5.24 renamed the KV cache argument of every model forward from ``past_key_values`` to ``cache`` (the old name
# is still accepted until 5.40, with a FutureWarning per call site). 5.17-5.23 know only ``past_key_values``, and
# their Mamba, Mamba-2 and FalconMamba only ``cache_params``: a cache passed under another name went into
# ``**kwargs`` unread, and every read started from a fresh state (never-route differed from ``slm.generate``).
CACHE_ARGUMENT = "cache" if transformers_version() >= Version("5.24.0.dev0") else "past_key_values"


def cache_argument(cache, model=None) -> dict:
    """``{name: cache}`` for a model forward, under the name this release's models take (see ``CACHE_ARGUMENT``), or
    the name ``model``'s own forward declares where it declares no other."""
    return {CACHE_ARGUMENT if model is None else cache_name(type(model)): cache}


@functools.lru_cache(maxsize=None)
def cache_name(model_class: type) -> str:
    """The name under which ``model_class``'s forward takes its cache (``CACHE_ARGUMENT`` where it names none)."""
    forward = getattr(model_class, "forward", None)
    try:
        params = inspect.signature(forward).parameters if forward is not None else {}
    except (TypeError, ValueError):  # (a compiled call or a builtin: the release's name)
        params = {}
    return next((name for name in (CACHE_ARGUMENT, "past_key_values", "cache_params") if name in params),
                CACHE_ARGUMENT)


# A long-RoPE model's own generate reads the whole sequence again where it first runs past its original context
# (the keys read with the short factors are dropped). 5.17 drops the cache there but reads only the new token, so its
# answers past that point are not the model's (a cache-free forward disagrees); 5.23 reads everything again.
LONG_ROPE_GENERATE_EXACT = transformers_version() >= Version("5.23.0.dev0")


# HF's recurrent and convolution cache layers (a state-space, linear-attention or convolution state per row)
LINEAR = cache_utils.LinearAttentionCacheLayerMixin


def layer_written(layer) -> bool | None:
    """Whether a cache layer holds what a read wrote: a recurrent or convolution layer after its first read, an
    attention layer while it holds keys; None for a layer that holds nothing of its own (KV sharing's placeholder).
    (``Cache.get_seq_length`` raises on a cache of recurrent layers only in 5.24, counts them in 5.25 and reads the
    first attention layer before.)"""
    if isinstance(layer, LINEAR) and any(layer.has_previous_state.values()):
        return True
    if isinstance(layer, cache_utils.CacheLayerMixin):
        return bool(getattr(layer, "is_initialized", False)) and int(layer.get_seq_length()) > 0
    return False if isinstance(layer, LINEAR) else None


def cache_is_empty(cache) -> bool:
    """Whether no layer of ``cache`` has read a token yet."""
    return not any(layer_written(layer) for layer in cache.layers)


def cache_of(kwargs: dict):
    """The KV cache in a model forward's keyword arguments, under any of its names (a hook sees what generate
    passed: ``cache_argument``)."""
    return next((kwargs[name] for name in (CACHE_ARGUMENT, "past_key_values", "cache_params") if name in kwargs), None)


# Before 5.23 a windowed layer recording its past hands its attention every key it recorded while HF's mask covers
# the window's (5.17: a read between two cuts past the window crashed, "size of tensor a (17) must match ... (16)");
# 5.23 hands it only the window's. (Slicing again is harmless, so the releases between are sliced too.)
SLICES_RECORDED_WINDOW = transformers_version() >= Version("5.23.0.dev0")


def record_past(cache, tokens: int) -> None:
    """Make ``cache``'s windowed layers keep what a cut back of up to ``tokens`` tokens needs (HF's rollback mode for
    assisted decoding: what they would drop past their window). Its recurrent and convolution layers record nothing:
    a rollback puts them back to a checkpoint instead (``hold_states``): exact on every release, with no per-token
    history of their states to keep or bound."""
    for layer in cache.layers:
        if not hasattr(layer, "activate_past_recording") or isinstance(layer, LINEAR):
            continue
        if not SLICES_RECORDED_WINDOW and isinstance(layer, cache_utils.DynamicSlidingWindowLayer):
            _hand_the_window_only(layer)
        layer.activate_past_recording()


def _hand_the_window_only(layer) -> None:
    """``layer.update`` returns the keys and values its window sees (the last ``sliding_window - 1`` and the new)."""
    update = layer.update

    def windowed(key_states, value_states, *args, **kwargs):
        keys, values = update(key_states, value_states, *args, **kwargs)
        visible = layer.sliding_window - 1 + key_states.shape[-2]
        return keys[:, :, -visible:, :], values[:, :, -visible:, :]

    layer.update = windowed


def crop_cache(cache, tokens: int) -> None:
    """Drop the last ``tokens`` tokens of an HF cache in place (a rollback). Dynamic layers crop by a negative count
    on every supported release (a windowed layer only where it records its past: ``record_past``); a static layer
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
            if isinstance(getattr(layer, "indexer_cumulative_length", None), torch.Tensor):
                layer.indexer_cumulative_length.sub_(tokens)  # (an indexed layer's index, Qwen4-Exp's: one per token)
        elif not isinstance(layer, LINEAR):
            layer.crop(-tokens)
        elif isinstance(layer, cache_utils.DynamicLayer):  # (its attention half: 5.24's mixed layers)
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
