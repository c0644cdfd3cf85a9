"""Step 2: at each mismatch, the LLM continues from the shared prefix plus the SLM's token
to the end of the sentence; the LLM's own sentence comes from its reference answer.

The LLM reads each answer once. Every continuation of that answer starts from the same
KV cache cut at its mismatch position: the cuts are left-padded into one batch, so no
prefix is read twice and the continuations of an answer decode together.
"""

from __future__ import annotations

import time

import torch
from transformers import PreTrainedModel, StoppingCriteria, StoppingCriteriaList
from transformers.cache_utils import DynamicCache

from ..compat import cache_argument
from ..core.features import input_device, lm_forward
from .reference import greedy_config
from .sentences import compare_sentences


class StopAtSentenceEnd(StoppingCriteria):
    """Stops a row once its newest token ends a sentence."""

    def __init__(self, ends: frozenset[int]) -> None:
        self.ends = torch.tensor(sorted(ends), dtype=torch.long)

    def __call__(self, input_ids: torch.LongTensor, scores, **kwargs) -> torch.BoolTensor:
        return torch.isin(input_ids[:, -1], self.ends.to(input_ids.device))


def _cut_cache(llm: PreTrainedModel, full: DynamicCache, lengths: list[int]) -> DynamicCache:
    """A batch cache whose row r holds the first ``lengths[r]`` positions of ``full``, left-padded."""
    width = max(lengths)
    cache = DynamicCache(config=llm.config)
    for layer_index, layer in enumerate(full.layers):
        keys, values = [], []
        for n in lengths:
            pad = width - n
            k, v = layer.keys[:, :, :n], layer.values[:, :, :n]
            keys.append(torch.nn.functional.pad(k, (0, 0, pad, 0)))
            values.append(torch.nn.functional.pad(v, (0, 0, pad, 0)))
        cache.update(torch.cat(keys), torch.cat(values), layer_index)
    return cache


@torch.no_grad()
def continue_mismatches(
    llm: PreTrainedModel,
    tokenizer,
    samples: list[dict],
    features: dict[str, torch.Tensor],
    ends: frozenset[int],
    eos_ids: list[int],
    pad_id: int,
    batch_size: int,
    max_tokens: int,
    context_tokens: int,
) -> dict:
    """LLM continuations and sentence pairs for every mismatch of a shard.

    Args:
        llm: the large model.
        tokenizer: shared tokenizer (decodes the sentences).
        samples: step-0 samples of the shard.
        features: step-1 tensors of the shard (``sample``, ``position``, ``slm_token``, ``real_token``).
        ends: sentence-end token ids.
        eos_ids, pad_id: special tokens.
        batch_size: continuations decoded together.
        max_tokens: bound on a continuation's length.
        context_tokens: preceding tokens shown to the verifier.

    Returns:
        ``{"mismatches": [{"sample", "position", "slm_token", "real_token", "continuation",
        "context", "slm_sentence", "llm_sentence", "identical"}], "tokens", "seconds"}``.
    """
    start = time.perf_counter()
    where = (features["slm_token"] != features["real_token"]).nonzero().flatten().tolist()
    by_sample: dict[int, list[int]] = {}
    for row in where:
        by_sample.setdefault(int(features["sample"][row]), []).append(row)
    config = greedy_config(llm, max_tokens, pad_id, eos_ids)
    stop = StoppingCriteriaList([StopAtSentenceEnd(ends)])
    eos_set = frozenset(eos_ids)
    device = input_device(llm)
    mismatches, tokens = [], 0
    for sample_index, rows in sorted(by_sample.items()):
        sample = samples[sample_index]
        sequence = sample["prompt_ids"] + sample["response_ids"]
        full = DynamicCache(config=llm.config)
        lm_forward(llm, torch.tensor([sequence]), None, None, full)
        tokens += len(sequence)
        for chunk_start in range(0, len(rows), batch_size):
            chunk = rows[chunk_start : chunk_start + batch_size]
            positions = [int(features["position"][r]) for r in chunk]
            slm_tokens = [int(features["slm_token"][r]) for r in chunk]
            lengths = [len(sample["prompt_ids"]) + j for j in positions]
            width = max(lengths)
            ids = torch.full((len(chunk), width + 1), pad_id, dtype=torch.long)
            mask = torch.zeros((len(chunk), width + 1), dtype=torch.long)
            for r, (n, s) in enumerate(zip(lengths, slm_tokens)):
                ids[r, width - n : width] = torch.tensor(sequence[:n])
                ids[r, width] = s
                mask[r, width - n :] = 1
            cache = _cut_cache(llm, full, lengths)
            out = llm.generate(
                input_ids=ids.to(device), attention_mask=mask.to(device), **cache_argument(cache),
                generation_config=config, stopping_criteria=stop,
            )
            for r, (row, j, s) in enumerate(zip(chunk, positions, slm_tokens)):
                generated = [] if s in eos_set else _trim(out[r, width + 1 :].tolist(), ends, eos_set)
                tokens += len(generated) + 1
                comparison = compare_sentences(
                    tokenizer, sample["response_ids"], j, s, generated, ends, eos_set, context_tokens
                )
                mismatches.append({
                    "sample": sample_index, "position": j, "row": row, "slm_token": s,
                    "real_token": int(features["real_token"][row]), "continuation": generated,
                    "context": comparison.context, "slm_sentence": comparison.slm_sentence,
                    "llm_sentence": comparison.llm_sentence, "identical": comparison.identical,
                })
    return {"mismatches": mismatches, "tokens": tokens, "seconds": time.perf_counter() - start}


def _trim(generated: list[int], ends: frozenset[int], eos: frozenset[int]) -> list[int]:
    """A continuation up to its first sentence end or end of answer (inclusive); later tokens are padding."""
    for i, token in enumerate(generated):
        if token in ends or token in eos:
            return generated[: i + 1]
    return generated
