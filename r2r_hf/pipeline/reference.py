"""Step 0: the LLM's own greedy answers, which every later step compares against."""

from __future__ import annotations

import time

import torch
from transformers import GenerationConfig, PreTrainedModel

from .prompts import Prompt


def left_pad(rows: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-pad token lists into (ids, attention_mask)."""
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, row in enumerate(rows):
        if row:
            ids[i, width - len(row) :] = torch.tensor(row)
            mask[i, width - len(row) :] = 1
    return ids, mask


def greedy_config(model: PreTrainedModel, max_new_tokens: int, pad_id: int, eos_ids: list[int]) -> GenerationConfig:
    """Plain greedy decoding: the model's recommended sampling or penalties are not applied."""
    return GenerationConfig(
        do_sample=False, max_new_tokens=max_new_tokens, pad_token_id=pad_id, eos_token_id=eos_ids,
        num_beams=1, repetition_penalty=1.0,
    )


def reference_responses(
    llm: PreTrainedModel,
    tokenizer,
    prompts: list[Prompt],
    max_new_tokens: int,
    pad_id: int,
    eos_ids: list[int],
) -> dict:
    """Greedy LLM answers for one shard of prompts (batched, left-padded).

    Returns:
        ``{"samples": [{"id", "prompt_ids", "response_ids", "finished"}], "tokens", "seconds"}``;
        ``finished`` is False for answers cut by ``max_new_tokens``.
    """
    start = time.perf_counter()
    prompt_ids = [p.ids(tokenizer) for p in prompts]  # their length fits the context (prompts.check_context)
    ids, mask = left_pad(prompt_ids, pad_id)
    device = llm.get_input_embeddings().weight.device
    out = llm.generate(
        input_ids=ids.to(device), attention_mask=mask.to(device),
        generation_config=greedy_config(llm, max_new_tokens, pad_id, eos_ids),
    )
    samples, tokens = [], 0
    for prompt, prompt_row, row in zip(prompts, prompt_ids, out[:, ids.shape[1] :].tolist()):
        end = next((i for i, t in enumerate(row) if t in eos_ids), None)
        response = row if end is None else row[: end + 1]
        tokens += len(response)
        samples.append({"id": prompt.id, "prompt_ids": prompt_row, "response_ids": response, "finished": end is not None})
    return {"samples": samples, "tokens": tokens, "seconds": time.perf_counter() - start}
