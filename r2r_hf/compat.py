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


# 5.25 keeps, where asked, each recurrent layer's states of its last tokens, so that a cut back can restore one
# (``activate_past_recording(recurrent_states_to_keep=n)``); 5.24 and before keep none and take no argument.
RECURRENT_HISTORY = transformers_version() >= Version("5.25.0.dev0")


# Before 5.23 a windowed layer recording its past hands its attention every key it recorded while HF's mask covers
# the window's (5.17: a read between two cuts past the window crashed, "size of tensor a (17) must match ... (16)");
# 5.23 hands it only the window's. (Slicing again is harmless, so the releases between are sliced too.)
SLICES_RECORDED_WINDOW = transformers_version() >= Version("5.23.0.dev0")


def record_past(cache, tokens: int) -> None:
    """Make ``cache``'s layers keep what a cut back of up to ``tokens`` tokens needs (HF's rollback mode for assisted
    decoding): a windowed or convolution layer what it would drop, a recurrent layer its last states (where the
    release keeps them: ``RECURRENT_HISTORY``)."""
    for layer in cache.layers:
        if not hasattr(layer, "activate_past_recording"):
            continue
        if not SLICES_RECORDED_WINDOW and isinstance(layer, cache_utils.DynamicSlidingWindowLayer):
            _hand_the_window_only(layer)
        if RECURRENT_HISTORY and isinstance(layer, LINEAR):
            # One more than the cut: a read of more tokens than it keeps records the state before the read in place
            # of the one before its kept states.
            layer.activate_past_recording(recurrent_states_to_keep=tokens + 1)
            # (5.25 gives every state of a layer one shared list, ``dict.fromkeys(range(n), [])``: one each.)
            layer.recurrent_states_history = {i: [] for i in range(layer.number_of_states)}
        else:
            layer.activate_past_recording()


def _hand_the_window_only(layer) -> None:
    """``layer.update`` returns the keys and values its window sees (the last ``sliding_window - 1`` and the new)."""
    update = layer.update

    def windowed(key_states, value_states, *args, **kwargs):
        keys, values = update(key_states, value_states, *args, **kwargs)
        visible = layer.sliding_window - 1 + key_states.shape[-2]
        return keys[:, :, -visible:, :], values[:, :, -visible:, :]

    layer.update = windowed


def stop_recording(cache) -> None:
    """Undo ``record_past`` on ``cache``'s recurrent and convolution layers (a static cache lent to a call that
    speculated, then to one that does not): what they recorded dropped, their states kept in place again."""
    for layer in cache.layers:
        if isinstance(layer, LINEAR) and layer.record_past:
            if any(layer.is_conv_states_initialized.values()):
                layer.crop(0)  # (HF's cut of nothing: conv states back to the kernel's width, history dropped)
            layer.record_past = False


def bound_past(cache, tokens: int) -> None:
    """Drop what ``cache``'s recurrent and convolution layers recorded beyond the last ``tokens`` tokens (HF keeps it
    until a cut, one state per token read: a long answer without a rollback would hold them all)."""
    for layer in cache.layers:
        if not (isinstance(layer, LINEAR) and layer.record_past):
            continue
        for i in range(layer.number_of_states):
            if layer.is_conv_states_initialized[i]:
                layer.conv_states[i] = layer.conv_states[i][..., -(layer.conv_kernel_size[i] + tokens):]
        history = getattr(layer, "recurrent_states_history", {})
        for i, states in history.items():
            history[i] = states[-tokens:]


def crop_cache(cache, tokens: int) -> None:
    """Drop the last ``tokens`` tokens of an HF cache in place (a rollback). Dynamic layers crop by a negative count
    on every supported release (a windowed, convolution or recurrent layer only where it records its past:
    ``record_past``); a static layer keeps its memory and moves back its device length (5.17's has no ``crop``), so
    captured calls over it stay valid, and a windowed static layer its host count too (R2R's static caches have none:
    ``static_cache``); a layer that is both (a hybrid's static layer) cuts back its recurrent half as well."""
    if tokens <= 0:
        return
    for layer in cache.layers:
        if isinstance(layer, LINEAR):
            check_recorded(layer, tokens)
        length = getattr(layer, "cumulative_length", None)
        if isinstance(length, torch.Tensor):
            length.sub_(tokens)
            if isinstance(getattr(layer, "cumulative_length_int", None), int):
                layer.cumulative_length_int -= tokens
            if isinstance(getattr(layer, "indexer_cumulative_length", None), torch.Tensor):
                layer.indexer_cumulative_length.sub_(tokens)  # (an indexed layer's index, Qwen4-Exp's: one per token)
            if isinstance(layer, LINEAR):
                LINEAR.crop(layer, -tokens)
        else:
            layer.crop(-tokens)


def check_recorded(layer, tokens: int) -> None:
    """Raise (never cut back wrongly) where a recurrent layer did not record the states of its last ``tokens``."""
    history = getattr(layer, "recurrent_states_history", {})
    short = [i for i in range(layer.number_of_states)
             if layer.is_recurrent_states_initialized[i] and len(history.get(i, ())) < tokens]
    if short:
        raise RuntimeError(f"a recurrent cache layer kept the states of fewer than the {tokens} tokens a rollback cuts "
                           "back (record_past was given a shorter horizon than the speculation's).")
