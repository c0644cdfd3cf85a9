"""What the R2R loop gives back: the output of ``generate``, and the streamer contract."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers.generation.streamers import BaseStreamer
from transformers.generation.utils import GenerateDecoderOnlyOutput


class RoutingAwareStreamer(BaseStreamer):
    """An HF streamer that also learns who wrote each token.

    The loop calls ``put_routing(routed, scores)`` right before each ``put(tokens)``:
    ``routed`` bool [B] (True where the LLM wrote the token) and ``scores`` float [B] (the
    router's scores, NaN for finished rows), both on the CPU. Any other HF streamer works too;
    it just is not told.
    """

    def put_routing(self, routed: torch.Tensor, scores: torch.Tensor) -> None:
        raise NotImplementedError


@dataclass
class R2RGenerateOutput(GenerateDecoderOnlyOutput):
    """HF's decoder-only generate output plus the routing record.

    Columns are the generated positions (``sequences[:, prompt_length:]``).

    Args:
        routed: bool [B, new_tokens]; True where the LLM wrote the token.
        router_scores: float [B, new_tokens]; the router's score at each step,
            NaN after a row finished (nothing was scored there).
        generated_mask: bool [B, new_tokens]; True for real generated tokens
            (the row was still running), False for padding after a row finished.
        llm_token_rate: routed / generated over real generated tokens of the batch.
        threshold: the threshold this call used.
        llm_budget: the call's LLM budget (the share of each answer's tokens the LLM may write), or None.
        llm_tokens: long [B]; tokens the LLM wrote in each row (what each row spent).
        counters: what the call did in units that do not depend on the machine (``core/counters.py``): forwards
            and host synchronisations per token, rows per LLM forward.
        speculation: per row, what speculation did (``core/ledger.Speculated``): long [B] each of
            ``pending_resolved``, ``agreed``, ``rejected`` and ``thrown`` (zeros where the call did not speculate).
    """

    routed: torch.BoolTensor | None = None
    router_scores: torch.FloatTensor | None = None
    generated_mask: torch.BoolTensor | None = None
    llm_token_rate: float | None = None
    threshold: float | None = None
    llm_budget: float | None = None
    llm_tokens: torch.LongTensor | None = None
    counters: dict | None = None
    speculation: dict | None = None
