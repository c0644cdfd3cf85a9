"""Tiny random models of ``families.py``'s families, and the pairs the family matrix runs.

A pair's LLM is wider, deeper and has more heads than its SLM (``families.GROWN``), as every real pair of a family
does; built independently it would agree with the SLM on almost no token (speculation would only ever reject), so
its input embedding starts with the SLM's and its lm_head is fitted, by least squares, to the SLM's logits over text
the SLM wrote (``agreeing``): the two then agree on a share of the tokens, as a real pair does, and differ on the
rest. Where the LLM ties its lm_head to its input embedding no fit is made (the tied variant stays unrelated). The
lm_heads are spread as in ``models.py`` (no float near-ties, no token past the tokenizer's).
"""

from __future__ import annotations

import dataclasses

import torch
import transformers
from transformers import PreTrainedModel

from ..core.features import HiddenStateCapture
from .families import BASE, FAMILIES, GROWN, PAIRS
from .models import EOS_ID, PAD_ID, TOKENIZER_VOCAB, _spread_lm_head, _unwritable_ids


def config_of(family: str, grown: bool = False):
    """The tiny config of ``family`` (the grown LLM's with ``grown``); per-layer lists follow the depth."""
    spec = FAMILIES[family]
    config_class = getattr(transformers, spec.config)
    known = {f.name for f in dataclasses.fields(config_class)} | set(getattr(config_class, "attribute_map", {}))
    values = {**BASE, **spec.settings, **(GROWN if grown else {}), **(spec.llm if grown else {})}
    values = {k: v for k, v in values.items() if k in known or k in spec.settings or k in spec.llm}
    small = spec.settings.get("num_hidden_layers", BASE["num_hidden_layers"])
    depth = values.get("num_hidden_layers", small)
    for key, value in values.items():  # (a list with one entry per layer is cycled to the grown depth)
        if isinstance(value, list) and len(value) == small and key not in spec.llm:
            values[key] = [value[i % small] for i in range(depth)]
    return config_class(**values)


def build(family: str, seed: int, grown: bool = False) -> PreTrainedModel:
    """A tiny random model of ``family`` (fp32, eval mode); the same seed gives the same weights."""
    config = config_of(family, grown)
    torch.manual_seed(seed)
    model = getattr(transformers, FAMILIES[family].model)(config)
    model.generation_config.pad_token_id, model.generation_config.eos_token_id = PAD_ID, EOS_ID
    return _spread_lm_head(model, scale=12.0, seed=seed + 100)


def agreeing(llm: PreTrainedModel, slm: PreTrainedModel, seed: int = 3) -> PreTrainedModel:
    """``llm`` made to agree with ``slm`` on part of the tokens: its input embedding starts with the SLM's, and its
    lm_head is the least-squares map from its own last hidden states to the SLM's logits over text the SLM wrote."""
    if llm.config.tie_word_embeddings:
        return llm  # (fitting the head would rewrite the embedding it reads)
    generator = torch.Generator().manual_seed(seed)
    prompts = torch.randint(3, TOKENIZER_VOCAB, (16, 4), generator=generator)
    with torch.no_grad():
        mine, theirs = llm.get_input_embeddings().weight, slm.get_input_embeddings().weight
        width = min(mine.shape[1], theirs.shape[1])
        mine[:, :width] = theirs[:, :width]
        mine[:, width:] *= 0.3
        text = slm.generate(prompts, max_new_tokens=24, do_sample=False, pad_token_id=PAD_ID, eos_token_id=10**6)
        want = slm(text).logits[..., :TOKENIZER_VOCAB].reshape(-1, TOKENIZER_VOCAB)
        with HiddenStateCapture(llm) as capture:
            llm(text)
            hidden = capture.hidden.reshape(-1, capture.hidden.shape[-1])
        head = llm.get_output_embeddings().weight
        head[:TOKENIZER_VOCAB] = torch.linalg.lstsq(hidden, want).solution.T
        head[list(_unwritable_ids())] = 0.0
    return llm.eval()


def build_pair(name: str) -> tuple[PreTrainedModel, PreTrainedModel]:
    """The fp32 SLM and LLM of pair ``name`` (a family with its grown LLM, or a mixed pair of ``MIXED``)."""
    slm_family, llm_family = PAIRS[name]
    slm = build(slm_family, seed=0)
    return slm, agreeing(build(llm_family, seed=1, grown=slm_family == llm_family), slm)


def unrelated_llm(name: str) -> PreTrainedModel:
    """An LLM for pair ``name``'s SLM that agrees with it on almost no token (another seed, no fit)."""
    slm_family, llm_family = PAIRS[name]
    return build(llm_family, seed=2, grown=slm_family == llm_family)
