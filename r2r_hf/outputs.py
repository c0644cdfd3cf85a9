"""What ``R2RForCausalLM.generate(..., return_dict_in_generate=True)`` returns."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers.generation.utils import GenerateDecoderOnlyOutput
from transformers.utils import ModelOutput


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
    """

    routed: torch.BoolTensor | None = None
    router_scores: torch.FloatTensor | None = None
    generated_mask: torch.BoolTensor | None = None
    llm_token_rate: float | None = None
    threshold: float | None = None


@dataclass
class R2RForwardOutput(ModelOutput):
    """Teacher-forced scoring of a sequence (``R2RForCausalLM.forward``).

    Args:
        logits: the SLM's logits [B, T, V].
        router_scores: float [B, T]; the router's score for the SLM's greedy
            proposal at each position (the token that would follow it).
    """

    logits: torch.FloatTensor | None = None
    router_scores: torch.FloatTensor | None = None
