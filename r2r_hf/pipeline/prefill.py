"""Step 1: the SLM reads each prompt + reference answer once and records, per answer token,
exactly what the router reads at inference: the top-k raw logits, the SLM's proposal and its
post-norm hidden state at the position that predicts that token, plus the token's embedding.
"""

from __future__ import annotations

import time

import torch
from transformers import PreTrainedModel

from ..core.features import read_features, slm_proposals


@torch.no_grad()
def slm_features(slm: PreTrainedModel, samples: list[dict], num_topk: int, vocab_size: int) -> tuple[dict, dict]:
    """Features of every response token of a shard, one SLM forward per sample.

    Row j of a sample is the step that predicts response token j: the features come from
    position ``len(prompt) + j - 1`` of the forward over prompt + response.

    Args:
        slm: the small model.
        samples: step-0 samples (``prompt_ids``, ``response_ids``).
        num_topk: how many sorted raw logits to keep.
        vocab_size: the shared vocabulary; the SLM's proposal is its argmax over it.

    Returns:
        (tensors, metadata): tensors ``topk_logits``, ``hidden``, ``token_embedding``,
        ``slm_token``, ``real_token``, ``sample``, ``position`` with one row per response token.
    """
    start = time.perf_counter()
    parts: dict[str, list[torch.Tensor]] = {k: [] for k in (
        "topk_logits", "hidden", "token_embedding", "slm_token", "real_token", "sample", "position")}
    tokens = 0
    for index, sample in enumerate(samples):
        prompt, response = sample["prompt_ids"], sample["response_ids"]
        if not response:
            continue
        ids = torch.tensor([prompt + response])
        # R + 1 kept positions are P-1 .. P+R-1; the last one predicts past the answer.
        logits, hidden, proposal = (t[:-1] for t in slm_proposals(slm, ids, vocab_size, keep=len(response) + 1))
        features = read_features(slm, logits, hidden, proposal, num_topk)
        parts["topk_logits"].append(features.topk_logits.to(hidden.dtype).cpu())
        parts["hidden"].append(hidden.cpu())
        parts["token_embedding"].append(features.token_embedding.to(hidden.dtype).cpu())
        parts["slm_token"].append(proposal.cpu())
        parts["real_token"].append(torch.tensor(response))
        parts["sample"].append(torch.full((len(response),), index, dtype=torch.int32))
        parts["position"].append(torch.arange(len(response), dtype=torch.int32))
        tokens += len(prompt) + len(response)
    if not parts["slm_token"]:  # every answer empty: an empty shard keeps the run consistent
        width = {"topk_logits": num_topk, "hidden": slm.config.get_text_config().hidden_size,
                 "token_embedding": slm.get_input_embeddings().embedding_dim}
        tensors = {k: torch.zeros(0, width[k]) if k in width else torch.zeros(0, dtype=torch.long) for k in parts}
    else:
        tensors = {k: torch.cat(v) for k, v in parts.items()}
    metadata = {
        "ids": [s["id"] for s in samples],
        "tokens": tokens,
        "seconds": time.perf_counter() - start,
    }
    return tensors, metadata
