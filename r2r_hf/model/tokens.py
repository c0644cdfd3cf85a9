"""Tokenizers: when two are the same for R2R, and which ids pad and end an answer."""

from __future__ import annotations

import hashlib
import json
from typing import Any

from transformers import AutoTokenizer, GenerationConfig


def tokenizer_fingerprint(tokenizer, upto: int | None = None) -> str:
    """A hash of the tokenizer's entries (and special tokens) with ids below ``upto`` (all when None).

    Equal fingerprints mean the same text for every id counted. With ``upto`` set to the ids both
    models can write, entries a tokenizer class appends past the models' vocabulary do not count.
    """
    vocab = tokenizer.get_vocab()
    entries = sorted((token, i) for token, i in vocab.items() if upto is None or i < upto)
    special = sorted(str(t) for t in tokenizer.all_special_tokens if upto is None or vocab.get(str(t), upto) < upto)
    return hashlib.sha256(json.dumps([entries, special]).encode()).hexdigest()[:16]


def check_same_tokenizer(slm_tok, llm_tok, upto: int, slm_name: str, llm_name: str) -> None:
    """Refuse two tokenizers that differ on an id both models can write (``id < upto``)."""
    if tokenizer_fingerprint(slm_tok, upto) != tokenizer_fingerprint(llm_tok, upto):
        slm_vocab, llm_vocab = ({t: i for t, i in tok.get_vocab().items() if i < upto} for tok in (slm_tok, llm_tok))
        differing = len(set(slm_vocab.items()) ^ set(llm_vocab.items()))
        raise ValueError(
            f"R2R needs one tokenizer shared by both models, but the tokenizers of {slm_name!r} and {llm_name!r} "
            f"differ in {differing} of the {upto} ids both models can write; pick models that share a tokenizer."
        )


def stored_tokenizer(model):
    """The tokenizer stored with a loaded model (its folder or the Hub cache), or None."""
    path = getattr(model, "name_or_path", None) or model.config.name_or_path
    if not path:
        return None
    try:
        return AutoTokenizer.from_pretrained(path, local_files_only=True)
    except Exception:  # noqa: BLE001 - no tokenizer stored with the model: nothing to compare
        return None


def load_tokenizer(model, **kwargs: Any):
    """The tokenizer of a loaded model, from where the model was read (its folder, the cache) or else the Hub.

    Args:
        model: a loaded model (its ``name_or_path`` says where it came from).
        kwargs: ``AutoTokenizer.from_pretrained`` arguments (``padding_side``...).
    """
    from .sources import resolve

    path = getattr(model, "name_or_path", None) or model.config.name_or_path
    try:
        return AutoTokenizer.from_pretrained(path, local_files_only=True, **kwargs)
    except OSError:  # downloaded without its tokenizer files: ask the Hub, if it can answer
        name, hub = resolve(path, "the model's tokenizer", {}, filename="tokenizer_config.json")
        return AutoTokenizer.from_pretrained(name, **hub, **kwargs)


def special_ids(tokenizer=None, generation_config: GenerationConfig | Any = None) -> tuple[int | None, list[int]]:
    """(pad id, EOS ids) for generating answers: the generation config's where it sets them, else the tokenizer's.

    Without a pad id, the first EOS id pads (as HF generate does).
    """
    eos = getattr(generation_config, "eos_token_id", None)
    if eos is None and tokenizer is not None:
        eos = tokenizer.eos_token_id
    eos_ids = [] if eos is None else [eos] if isinstance(eos, int) else list(eos)
    pad = getattr(generation_config, "pad_token_id", None)
    if pad is None and tokenizer is not None:
        pad = tokenizer.pad_token_id
    if pad is None and eos_ids:
        pad = eos_ids[0]
    return pad, eos_ids
