"""``LabelSettings``: everything that decides a labeling run's labels, declared once (defaults, help, flags).

Light on purpose (stdlib at import): ``r2r-hf label --help`` reads these declarations before torch loads.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from ..fields import setting
from .steps import LEGACY_SET

# The fields that decide steps 0-2, recorded in a run's manifest (a resume must match them).
RUN_FIELDS = ("slm", "llm", "dtype", "max_new_tokens", "batch_size", "num_topk_logits", "continuation_max_tokens",
              "context_tokens")


@dataclass
class LabelSettings:
    """Everything that decides the labels.

    The run's fields (``RUN_FIELDS``: models, dtype, lengths) decide steps 0-2 and are recorded in
    the manifest; a resume must match them. The verifier fields decide steps 3-4 and are recorded
    with the label set they write.

    Args:
        slm, llm: Hub ids or folders of the pair.
        dtype: one compute dtype for every model and step.
        max_new_tokens: bound on the LLM's reference answers.
        batch_size: prompts per shard, also the batch of every batched step.
        num_topk_logits: sorted SLM logits kept per token.
        continuation_max_tokens: bound on a continuation to its sentence end.
        context_tokens: preceding answer tokens a judge sees.
        verifiers: the verifier chain, e.g. ``"code,llm"`` (``verifiers.KNOWN``).
        judge: Hub id or folder of the ``llm`` verifier's judge (None: the LLM).
        judge_threshold: the judge calls a mismatch divergent where its score reaches this.
        logprob_threshold: the logprob verifier calls a mismatch neutral where the LLM's log-probability of the
            SLM's token reaches this.
        labels: the label set's name (default: the chain, e.g. ``code+llm``).
    """

    slm: str = setting(help="SLM Hub id or folder")
    llm: str = setting(help="LLM Hub id or folder")
    dtype: str = setting("bfloat16", "compute dtype of every model")
    max_new_tokens: int = setting(1024, "bound on the LLM's reference answers", "positive_int")
    batch_size: int = setting(8, "prompts per shard and per batch", "positive_int")
    num_topk_logits: int = setting(100, "sorted SLM logits kept per token (the router's input)", "positive_int",
                                   cli=False)
    continuation_max_tokens: int = setting(128, "bound on an LLM continuation to its sentence end", "positive_int")
    context_tokens: int = setting(384, "preceding answer tokens the judge sees", "non_negative_int")
    verifiers: str = setting("llm", "verifier chain, e.g. code,llm (code: neutral where the program cannot change; "
                                    "llm: a judge model's verdict); a model name here means --verifier llm "
                                    "--judge MODEL", flag="--verifier")
    judge: str | None = setting(None, "judge model of the llm verifier (Hub id or folder; default: the LLM)")
    judge_threshold: float = setting(0.5, "the judge calls a difference divergent where its score "
                                          "P(1)/(P(0)+P(1)) reaches this", "fraction")
    logprob_threshold: float = setting(-1.0, "the logprob verifier calls a difference neutral where the LLM's "
                                             "log-probability of the SLM's token reaches this (at most 0)",
                                       "finite_non_positive")
    labels: str | None = setting(None, "name of the label set to write (default: the chain, e.g. code+llm); "
                                       "relabeling a run with other verifiers writes a new set beside the old ones")

    def __post_init__(self) -> None:
        import torch  # here, not at import: the CLI reads the declarations before torch loads

        from .verifiers import parse_chain

        for name in ("max_new_tokens", "batch_size", "num_topk_logits", "continuation_max_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}.")
        if self.context_tokens < 0:
            raise ValueError(f"context_tokens must be >= 0, got {self.context_tokens}.")
        if not isinstance(getattr(torch, self.dtype, None), torch.dtype):
            raise ValueError(f"dtype {self.dtype!r} is not a torch dtype; use bfloat16, float16 or float32.")
        self.chain = parse_chain(self.verifiers)
        if not 0 <= self.judge_threshold <= 1:
            raise ValueError(f"judge_threshold must be in [0, 1], got {self.judge_threshold}.")
        if not -math.inf < self.logprob_threshold <= 0:
            raise ValueError(f"logprob_threshold is a log-probability, a finite number at most 0; got "
                             f"{self.logprob_threshold}.")
        self.label_set = self.labels or "+".join(self.chain)
        if not self.label_set.replace("+", "").replace("-", "").replace("_", "").isalnum():
            raise ValueError(f"The label set name {self.label_set!r} must be letters, digits, '+', '-' or '_'.")
        if self.label_set == LEGACY_SET:
            raise ValueError(f"{LEGACY_SET!r} names the labels of an older run format; pick another with labels=.")

    def run(self) -> dict[str, Any]:
        """The fields recorded in the manifest."""
        return {k: getattr(self, k) for k in RUN_FIELDS}
