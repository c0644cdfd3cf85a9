"""Which models R2R runs on which path, and the one sentence it says where it cannot.

R2R runs any causal LM through HF's own forward, so most families need nothing here. What does differ by family is
checked on the model itself (once per model, kept in the core's notes on it), not looked up by name:

* ``rollback_problem``  speculation cuts both caches back where the LLM rejects a token; a layer whose state is not
                        a list of keys and values (a recurrent or state-space block, a state kept on the module)
                        cannot be cut back, so speculation is off for such a model (said once: ``speculation_for``).
* ``refusal``           a model R2R refuses outright, at ``set_models`` (``UnsupportedModel``).

The family matrix (``r2r_hf/testing/matrix.py``, docs/model_families.md) shows what each family gets on each path.
"""

from __future__ import annotations

import logging

import torch

from .compat import crop_cache
from .core.notes import notes

logger = logging.getLogger(__name__)
_said: set[str] = set()


class UnsupportedModel(ValueError):
    """A model (or a path for it) R2R refuses: the message names the family and what to use instead."""


def family(model: torch.nn.Module) -> str:
    """How a message names a model's family: its class and model type (``MambaForCausalLM ('mamba')``)."""
    return f"{type(model).__name__} ({getattr(model.config, 'model_type', '?')!r})"


def say_once(message: str) -> None:
    """Log ``message`` as a warning the first time it is said in this process."""
    if message not in _said:
        _said.add(message)
        logger.warning(message)


def long_rope_switch(model: torch.nn.Module) -> int | None:
    """Where a long-RoPE model (Phi-3-mini-128k, Phi-3.5, Phi-4-mini) switches to its long rotary factors: its
    original context (None for any other model). Its factors follow the longest position of each forward, so its
    own ``generate`` re-reads the whole sequence when the sequence first runs past it (``model_calls.read_start``)."""
    rope = getattr(model.config, "rope_parameters", None) or getattr(model.config, "rope_scaling", None) or {}
    if not isinstance(rope, dict) or rope.get("rope_type", rope.get("type")) != "longrope":
        return None
    return rope.get("original_max_position_embeddings") or getattr(model.config, "original_max_position_embeddings")


def rollback_problem(model: torch.nn.Module) -> str | None:
    """Why a rollback cannot cut ``model``'s cache back exactly, or None where it can.

    Checked once per model on its own weights: 4 tokens read, then 2 more, cut back by 2 and 2 others read; the
    logits must be those of one plain forward over the 6 tokens kept, and no layer may hold a recurrent state.
    """
    known = notes(model)
    if "rollback_problem" not in known:
        known["rollback_problem"] = _rollback_probe(model) if long_rope_switch(model) is None else (
            "its long-context rotary factors follow the sequence's length, so a cut back across its original context "
            "would keep keys read with the other factors")
    return known["rollback_problem"]


def _rollback_probe(model: torch.nn.Module) -> str | None:
    from .core.features import input_device, lm_forward
    from .core.layouts.model_calls import make_cache

    device = input_device(model)
    vocab = model.get_input_embeddings().weight.shape[0]
    ids = (torch.arange(8, device=device)[None] * 37 + 3) % vocab
    kept = torch.cat([ids[:, :4], ids[:, 6:]], 1)
    positions = torch.arange(6, device=device)[None]
    cache = make_cache(model, None, 8, rollback=True)
    with torch.inference_mode():
        try:
            lm_forward(model, ids[:, :4], None, positions[:, :4], cache)
            lm_forward(model, ids[:, 4:6], None, positions[:, 4:6], cache)
            crop_cache(cache, 2)
            got = lm_forward(model, ids[:, 6:], None, positions[:, 4:6], cache)[0, -1].float()
        except Exception as err:  # noqa: BLE001 - any failure means: it cannot be cut back
            return f"its cache cannot be cut back to an earlier token (transformers raises {type(err).__name__})"
        want = lm_forward(model, kept, None, positions, None)[0, -1].float()
    if any(any(getattr(layer, "is_recurrent_states_initialized", {}).values()) for layer in cache.layers):
        return "its recurrent (state-space) layers keep a state that cannot be cut back to an earlier token"
    tolerance = 1e-3 if model.dtype == torch.float32 else 5e-2
    if not bool((got - want).abs().max() <= tolerance * want.abs().max().clamp(min=1e-6)):
        return "its state does not follow its cache when the cache is cut back (a state kept on its modules)"
    return None


def speculation_problem(slm: torch.nn.Module, llm: torch.nn.Module) -> str | None:
    """Why a pair cannot speculate, as the sentence R2R says (once), or None where both models can."""
    for model in (slm, llm):
        problem = rollback_problem(model)
        if problem is not None:
            return (f"speculation is off for {family(model)}: {problem}; R2R decodes it without speculation (the "
                    "same answers), and a transformer SLM and LLM (Llama, Qwen, Gemma, Mistral...) can speculate.")
    return None
