"""The ``llm`` verifier (the paper's): a judge model reads the two versions of a sentence and says
whether they lead the answer to different places.

A small judge writes "1" for almost anything when asked to answer with a digit (our 1.5B judged
2,613 of 2,616 mismatches divergent that way). So the judge here is not asked to write: one
forward gives its probabilities for "0" and "1" as the next token, the score is
P(1) / (P(0) + P(1)), and a mismatch is divergent where the score reaches a threshold chosen on
a hand-checked set (``benchmarks/router/calibrate_judge.py``). Worked examples in the instructions show
the judge what neutral means. The instructions' KV cache is computed once and shared by every
batch. The judge need not share the pair's tokenizer: it reads text.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from transformers import PreTrainedModel
from transformers.cache_utils import DynamicCache

from ...core.features import HiddenStateCapture, lm_forward
from ...model.tokens import special_ids
from ..store import text_hash
from ..classes import Decision
from .base import Mismatch, Verdict

PROMPT_VERSION = 3  # 3: the two digits' logits computed in float32 (bf16 logits gave a handful of scores)
INSTRUCTIONS = """Two versions of the same passage of an answer share everything before the token marked \
<<like this>>; there they differ. Decide whether the difference sends the answer somewhere else.

Answer 1 (divergent) if it changes what the answer does or concludes: the logic, a value, a condition, \
a step of the method, what the code computes, or a claim.
Answer 0 (neutral) if both versions end up in the same place: other wording, a synonym, another variable \
name used consistently, formatting or spacing, a comment or explanation phrased differently, or the same \
computation written another way.

Answer with one digit, 0 or 1.

Example
Context: def total(prices):
Version A:     <<result>> = 0
Version B:     <<s>> = 0
Answer: 0

Example
Context: def mean(xs):
Version A:     return sum(xs) / <<len>>(xs)
Version B:     return sum(xs) / <<max>>(len(xs), 1)
Answer: 1

Example
Context: The list is sorted first.
Version A: <<Then>> we scan it once to find the pair.
Version B: <<Next>>, we scan it once to find the pair.
Answer: 0

Example
Context: def is_even(n):
Version A:     return n % 2 <<==>> 0
Version B:     return n % 2 <<!=>> 0
Answer: 1"""

QUESTION = "Context: {context}\nVersion A: {slm}\nVersion B: {llm}\nAnswer:"


def render(tokenizer, context: str, slm: str, llm: str) -> list[int]:
    """Token ids of one judge request (chat template when the tokenizer has one), ending where the digit goes."""
    question = QUESTION.format(context=context.strip() or "(start of the answer)", slm=slm, llm=llm)
    if getattr(tokenizer, "chat_template", None):
        messages = [{"role": "system", "content": INSTRUCTIONS}, {"role": "user", "content": question}]
        out = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        return list(out["input_ids"] if hasattr(out, "keys") else out)
    return tokenizer(INSTRUCTIONS + "\n\n" + question, add_special_tokens=False)["input_ids"]


def shared_prefix(tokenizer) -> list[int]:
    """The token prefix every request starts with (instructions and template preamble)."""
    a = render(tokenizer, "alpha", "A <<x>> b.", "A <<y>> b.")
    b = render(tokenizer, "omega", "C <<z>> d!", "C <<w>> d!")
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return a[:n]


def digit_ids(tokenizer) -> tuple[int, int]:
    """The ids of "0" and "1" as the judge would write them first."""
    ids = []
    for digit in "01":
        encoded = tokenizer.encode(digit, add_special_tokens=False)
        if len(encoded) != 1:
            raise ValueError(f"The judge's tokenizer writes {digit!r} as {len(encoded)} tokens; the llm verifier needs "
                             "a judge whose tokenizer has single tokens for 0 and 1.")
        ids.append(encoded[0])
    return ids[0], ids[1]


class JudgeVerifier:
    """Batched, prefix-cached scoring of sentence pairs by a judge model.

    Args:
        model: any causal LM (default in the pipeline: the LLM).
        tokenizer: its tokenizer.
        threshold: divergent where P(1) / (P(0) + P(1)) >= threshold.
        batch_size: requests scored together.
        share_prefix: reuse the instructions' KV cache across requests.
        model_name: how the judge is named in the settings (its Hub id or folder).
    """

    name = "llm"

    @torch.no_grad()
    def __init__(self, model: PreTrainedModel, tokenizer, threshold: float = 0.5, batch_size: int = 8,
                 share_prefix: bool = True, model_name: str | None = None) -> None:
        if not 0 <= threshold <= 1:
            raise ValueError(f"The judge threshold must be in [0, 1], got {threshold}.")
        self.model, self.tokenizer, self.threshold, self.batch_size = model, tokenizer, threshold, batch_size
        self.model_name = model_name or getattr(model, "name_or_path", "") or type(model).__name__
        self.pad_id = special_ids(tokenizer, model.generation_config)[0]
        self.digits = digit_ids(tokenizer)
        self.prefix = shared_prefix(tokenizer) if share_prefix else []
        self._prefix_cache = None
        if self.prefix:
            self._prefix_cache = DynamicCache(config=model.config)
            lm_forward(model, torch.tensor([self.prefix]), None, None, self._prefix_cache)

    def key(self) -> str:
        """Scores depend on the judge and the prompt, not on the threshold: scores are reused across thresholds."""
        return f"llm-{text_hash(self.model_name, PROMPT_VERSION, str(self.model.dtype))}"

    def settings(self) -> dict[str, Any]:
        return {"name": self.name, "judge": self.model_name, "threshold": self.threshold,
                "prompt_version": PROMPT_VERSION, "dtype": str(self.model.dtype)}

    def decide(self, stored: dict[str, Any]) -> Decision:
        return Decision(int(stored["score"] >= self.threshold))

    def judge(self, items: list[Mismatch]) -> list[Verdict]:
        verdicts = []
        for start in range(0, len(items), self.batch_size):
            chunk = items[start : start + self.batch_size]
            scores = self.scores([render(self.tokenizer, m.context, m.slm_sentence, m.llm_sentence) for m in chunk])
            verdicts += [Verdict(Decision(int(s >= self.threshold)), "judge", round(s, 6)) for s in scores]
        return verdicts

    @torch.no_grad()
    def scores(self, requests: list[list[int]]) -> list[float]:
        """P(1) / (P(0) + P(1)) for the next token of each request."""
        n = len(self.prefix) if self._prefix_cache is not None and all(
            r[: len(self.prefix)] == self.prefix for r in requests) else 0
        tails = [r[n:] for r in requests]
        width = max(len(t) for t in tails)
        ids = torch.full((len(requests), n + width), self.pad_id, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for row, tail in enumerate(tails):
            if n:
                ids[row, :n] = torch.tensor(self.prefix)
                mask[row, :n] = 1
            ids[row, n + width - len(tail) :] = torch.tensor(tail)  # padding sits between the prefix and the tail
            mask[row, n + width - len(tail) :] = 1
        cache = None
        if n:
            cache = copy.deepcopy(self._prefix_cache)
            cache.batch_repeat_interleave(len(requests))
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        with HiddenStateCapture(self.model) as capture:
            lm_forward(self.model, ids[:, n:], mask, positions[:, n:], cache)
            hidden = capture.hidden[:, -1].float()
        # The two digits' logits in float32: in bf16 the difference of two logits near 20 has a resolution
        # of about 0.1, which left a handful of distinct scores.
        head = self.model.get_output_embeddings()
        logits = hidden @ head.weight[list(self.digits)].float().T
        if getattr(head, "bias", None) is not None:
            logits = logits + head.bias[list(self.digits)].float()
        return logits.log_softmax(-1)[:, 1].exp().tolist()
