"""Step 2: at each mismatch, the LLM continues from the shared prefix plus the SLM's token to the end of the
sentence; the LLM's own sentence comes from its reference answer.

A continuation starts from its answer's cache cut at the mismatch (the answer is never read again: where the answer
was written in the same batch, its cache is the one it was written with), and decodes in the labeling run's one
continuous batch beside other answers and continuations (``batching.Batch``). Each mismatch also records the LLM's
log-probability of the SLM's token and of its own there, read off the LLM's hidden state at that step.

A record holds token ids only (``RECORD_FIELDS``); the two sentences a verifier compares are rebuilt from them
(``sentences.compare_sentences``), so a run's continuations stay small enough to keep with the router they train.
"""

from __future__ import annotations

import torch

from .batching import KV, Row, cut
from .sentences import compare_sentences

RECORD_FIELDS = ("sample", "position", "row", "slm_token", "real_token", "continuation", "identical",
                 "llm_logprob", "llm_own_logprob")


def mismatch_positions(slm_tokens: torch.Tensor, real_tokens: torch.Tensor) -> list[int]:
    """The answer positions where the SLM's proposal differs from the LLM's token."""
    return (slm_tokens != real_tokens).nonzero().flatten().tolist()


@torch.no_grad()
def logprobs(llm, hidden: torch.Tensor, tokens: list[int]) -> list[float]:
    """The LLM's log-probability of ``tokens[i]`` after its post-norm hidden state ``hidden[i]`` (float32)."""
    if not tokens:
        return []
    head = llm.get_output_embeddings()
    logits = head(hidden.to(head.weight.device, head.weight.dtype)).float().log_softmax(-1)
    return logits[torch.arange(len(tokens)), torch.tensor(tokens, device=logits.device)].tolist()


def continuation_row(key, answer_kv: KV, read: int, slm_token: int, stops: frozenset[int], max_tokens: int) -> tuple[Row, KV]:
    """The row that continues after ``slm_token`` from the first ``read`` tokens of its answer's cache."""
    return Row(key, slm_token, max_tokens, stops), cut(answer_kv, read)


def record(tokenizer, sample: dict, index: int, position: int, slm_token: int, continuation: list[int],
           ends: frozenset[int], eos: frozenset[int], context_tokens: int, logprob: tuple[float, float]) -> dict:
    """One mismatch as a continuations shard keeps it (``row``, its index in the shard's features, is set when the
    shard is written)."""
    comparison = compare_sentences(tokenizer, sample["response_ids"], position, slm_token, continuation, ends, eos,
                                   context_tokens)
    return {"sample": index, "position": position, "row": None, "slm_token": slm_token,
            "real_token": sample["response_ids"][position], "continuation": continuation,
            "identical": comparison.identical, "llm_logprob": round(logprob[0], 4),
            "llm_own_logprob": round(logprob[1], 4)}
