"""Loading the SLM and LLM a router names, and checking that the three fit together."""

from __future__ import annotations

from typing import Any

import torch
from transformers import AutoModelForCausalLM, PreTrainedModel

from ..config import R2RConfig
from .hub import HUB_KWARGS
from .sources import Unavailable, resolve
from .tokens import check_same_tokenizer, stored_tokenizer

# Keyword arguments that place or shape model weights; at top level they apply to the SLM and LLM.
MODEL_KWARGS = ("dtype", "torch_dtype", "device_map", "attn_implementation", "max_memory", "offload_folder")

# Padded vocabularies (e.g. 151,936 vs 152,064 for Qwen2.5 sizes) differ by a few hundred rows;
# a larger gap means two different tokenizers.
MAX_VOCAB_PADDING = 1024


def load_base_model(
    role: str,
    name_or_path: str | None,
    revision: str | None,
    kwargs: dict[str, Any],
    hint: str | None = None,
) -> PreTrainedModel:
    """Load the SLM or LLM with ``AutoModelForCausalLM``, turning failures into one clear sentence.

    A name the Hub cannot serve here is read from the Hugging Face cache or a registered local copy, or
    refused at once (``sources.resolve``): no retried requests.

    Args:
        role: ``"slm"`` or ``"llm"`` (used in messages).
        name_or_path: Hub id or local folder.
        revision: Hub revision, or None for the default branch.
        kwargs: extra ``from_pretrained`` arguments (device_map, dtype, quantization_config...).
        hint: what to do, said when it fails (default: pass ``{role}=`` or fix the router's config).
    """
    what = role.upper() if role in ("slm", "llm") else role
    if not name_or_path:
        raise ValueError(f"The router config names no {what}; pass {role}= (a Hub id, a local folder or a loaded model).")
    kwargs = dict(kwargs)
    if revision and "revision" not in kwargs:
        kwargs["revision"] = revision
    hint = hint or f"pass {role}= (a local folder or an already-loaded model), or fix {role}_name_or_path in the " \
                   "router's config"
    hub = {k: kwargs.pop(k) for k in (*HUB_KWARGS, "revision") if k in kwargs}
    try:
        name_or_path, hub = resolve(name_or_path, f"the {what}", hub)
    except Unavailable as err:
        raise OSError(f"Could not load the {what} {name_or_path!r}: {err.reason}; {hint}.") from None
    kwargs.update(hub)
    try:
        return AutoModelForCausalLM.from_pretrained(name_or_path, **kwargs)
    except (OSError, ValueError) as err:
        reason = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise OSError(f"Could not load the {what} {name_or_path!r} ({reason}); {hint}.") from err


def bf16_is_slow_here(device: str | torch.device = "cpu") -> bool:
    """Whether bfloat16 matmuls are slow on ``device``: a CPU without AVX-512 (torch falls back to a reference kernel,
    measured at 0.6 GFLOP/s against 51 for float32 on a 2-core AVX2 EPYC)."""
    if torch.device(device).type != "cpu":
        return False
    return "AVX512" not in torch.backends.cpu.get_cpu_capability()


def split_loading_kwargs(
    kwargs: dict[str, Any], slm_kwargs: dict[str, Any] | None, llm_kwargs: dict[str, Any] | None
) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
    """Split ``from_pretrained`` keyword arguments into (router, slm, llm) argument sets.

    Hub arguments go to all three; placement arguments (dtype, device_map...) go to the
    SLM and LLM only, because the router stays in float32 next to the SLM's lm_head.
    """
    if "quantization_config" in kwargs:
        raise ValueError(
            "quantization_config applies to one model: pass it in llm_kwargs (or slm_kwargs), "
            "e.g. llm_kwargs={'quantization_config': BitsAndBytesConfig(load_in_4bit=True)}."
        )
    router_kwargs = dict(kwargs)
    shared = {k: router_kwargs[k] for k in HUB_KWARGS if k in router_kwargs}
    placement = {k: router_kwargs.pop(k) for k in MODEL_KWARGS if k in router_kwargs}
    slm = {**shared, **placement, **(slm_kwargs or {})}
    llm = {**shared, **placement, **(llm_kwargs or {})}
    return router_kwargs, slm, llm


def vocab_size(model: PreTrainedModel) -> int:
    """Width of the model's lm_head (its padded vocabulary)."""
    head = model.get_output_embeddings()
    width = getattr(head, "out_features", None)
    return int(width) if width else int(model.config.get_text_config().vocab_size)


def hidden_size(model: PreTrainedModel) -> int:
    """Width of the hidden state the lm_head reads."""
    head = model.get_output_embeddings()
    width = getattr(head, "in_features", None)
    return int(width) if width else int(model.config.get_text_config().hidden_size)


def shared_vocab_size(slm: PreTrainedModel, llm: PreTrainedModel) -> int:
    """The vocabulary both models can write; refuses pairs that cannot share one tokenizer."""
    slm_vocab, llm_vocab = vocab_size(slm), vocab_size(llm)
    if abs(slm_vocab - llm_vocab) > MAX_VOCAB_PADDING:
        raise ValueError(
            f"R2R needs one tokenizer shared by both models, but the SLM has a vocabulary of {slm_vocab} "
            f"and the LLM of {llm_vocab}; pick an SLM and LLM from the same family."
        )
    shared = min(slm_vocab, llm_vocab)
    slm_tok, llm_tok = stored_tokenizer(slm), stored_tokenizer(llm)
    if slm_tok is not None and llm_tok is not None:  # a model without a stored tokenizer cannot be checked
        check_same_tokenizer(slm_tok, llm_tok, shared, slm.name_or_path, llm.name_or_path)
    return shared


def context_length(slm: PreTrainedModel, llm: PreTrainedModel) -> int | None:
    """The longest sequence both models were built for (the smaller ``max_position_embeddings``), if known."""
    limits = [getattr(m.config.get_text_config(), "max_position_embeddings", None) for m in (slm, llm)]
    limits = [x for x in limits if x]
    return min(limits) if limits else None


def check_router_fits(config: R2RConfig, slm: PreTrainedModel) -> None:
    """Refuse an SLM whose hidden or embedding width differs from what the router was built for."""
    check_router_sizes(
        config, hidden_size(slm), slm.get_input_embeddings().embedding_dim, vocab_size(slm), slm.name_or_path
    )


def check_router_sizes(config: R2RConfig, slm_hidden: int, slm_embed: int, slm_vocab: int, slm_name: str) -> None:
    """The size checks of ``check_router_fits``, from sizes alone (e.g. read from the SLM's config)."""
    if config.router_type != "mlp":
        return
    if config.slm_hidden_size != slm_hidden:
        raise ValueError(
            f"The router reads SLM hidden states of size {config.slm_hidden_size}, but the SLM "
            f"{slm_name!r} has hidden size {slm_hidden}; load the SLM this router was trained for "
            f"({config.slm_name_or_path!r})."
        )
    if config.slm_embedding_size != slm_embed:
        raise ValueError(
            f"The router reads token embeddings of size {config.slm_embedding_size}, but the SLM "
            f"{slm_name!r} has embedding size {slm_embed}; load the SLM this router was trained for "
            f"({config.slm_name_or_path!r})."
        )
    if config.num_topk_logits > slm_vocab:
        raise ValueError(
            f"The router reads the top {config.num_topk_logits} logits but the SLM has only {slm_vocab} tokens; "
            "use a smaller num_topk_logits."
        )


def model_revision(model: PreTrainedModel) -> str | None:
    """The Hub revision a model was loaded from, where transformers recorded it."""
    return getattr(model.config, "_commit_hash", None) or None


def config_from_models(slm: PreTrainedModel, llm: PreTrainedModel, **overrides: Any) -> R2RConfig:
    """An R2RConfig sized from the SLM that names both models (Hub id or folder)."""
    values: dict[str, Any] = dict(
        slm_name_or_path=slm.name_or_path or None,
        llm_name_or_path=llm.name_or_path or None,
        slm_revision=model_revision(slm),
        llm_revision=model_revision(llm),
        slm_hidden_size=hidden_size(slm),
        slm_embedding_size=slm.get_input_embeddings().embedding_dim,
    )
    values.update(overrides)
    return R2RConfig(**values)


def is_loaded_model(value: object) -> bool:
    return isinstance(value, torch.nn.Module)
