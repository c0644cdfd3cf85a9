"""Step 3: a verifier model judges each pair of sentences: neutral (0) or divergent (1).

Identical sentences are neutral without a call. The verifier answers greedily in a few
tokens; an answer without a 0 or 1 is recorded as unparsable (-1), counted and excluded
from training, never guessed. The fixed instructions are the same for every call: their
KV cache is computed once and shared by every batch.
"""

from __future__ import annotations

import copy
import re
import time

import torch
from transformers import PreTrainedModel
from transformers.cache_utils import DynamicCache

from ..core.features import input_device, lm_forward
from ..model.tokens import special_ids
from .reference import greedy_config

INSTRUCTIONS = """You judge whether two versions of a sentence, written while answering the same request, \
would lead the answer in different directions. Both versions follow the same context. They first differ at \
the token marked <<like this>>.

Reply 1 (divergent) if the difference changes the meaning, the reasoning, the logic, the code's behaviour or \
a conclusion, adds or drops information, shifts the focus, or contradicts the other version.
Reply 0 (neutral) if the difference is only surface: wording, tense, formatting, spacing, an abbreviation or \
a synonym, and both versions lead to the same place.

Reply with one digit, 0 or 1, and nothing else.

Example 1
Context: We need the sum of the first ten odd numbers.
Sentence A: <<The>> sum of the first n odd numbers is n squared.
Sentence B: <<This>> sum of the first n odd numbers is n squared.
Reply: 0

Example 2
Context: We need the sum of the first ten odd numbers.
Sentence A: Let me <<add>> them one by one.
Sentence B: Let me <<use>> the formula n squared instead.
Reply: 1"""

QUESTION = "Context: {context}\nSentence A: {slm}\nSentence B: {llm}\nReply:"
_DIGIT = re.compile(r"\d")


def parse_verdict(answer: str) -> int:
    """The verifier's first digit if it is 0 or 1; -1 (unparsable) for no digit or another one."""
    match = _DIGIT.search(answer)
    return int(match.group(0)) if match and match.group(0) in "01" else -1


def render(tokenizer, context: str, slm: str, llm: str) -> list[int]:
    """Token ids of one verifier request (chat template when the tokenizer has one)."""
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


class Verifier:
    """Batched, prefix-cached judging of sentence pairs.

    Args:
        model: any causal chat LM (default in the pipeline: the LLM).
        tokenizer: its tokenizer.
        max_new_tokens: answer length bound.
        batch_size: requests decoded together.
        share_prefix: reuse the instructions' KV cache across requests.
    """

    @torch.no_grad()
    def __init__(self, model: PreTrainedModel, tokenizer, max_new_tokens: int = 4, batch_size: int = 8,
                 share_prefix: bool = True) -> None:
        self.model, self.tokenizer = model, tokenizer
        self.batch_size = batch_size
        pad, eos = special_ids(tokenizer, model.generation_config)
        self.pad_id = pad
        self.config = greedy_config(model, max_new_tokens, pad, eos)
        self.prefix = shared_prefix(tokenizer) if share_prefix else []
        self._prefix_cache = None
        if self.prefix:
            self._prefix_cache = DynamicCache(config=model.config)
            lm_forward(model, torch.tensor([self.prefix]), None, None, self._prefix_cache)

    def judge(self, items: list[dict]) -> tuple[list[dict], int]:
        """Verdicts for ``items`` (dicts with ``context``, ``slm_sentence``, ``llm_sentence``).

        Returns:
            (one ``{"verdict", "answer"}`` per item, tokens processed).
        """
        results, tokens = [], 0
        for start in range(0, len(items), self.batch_size):
            chunk = items[start : start + self.batch_size]
            requests = [render(self.tokenizer, i["context"], i["slm_sentence"], i["llm_sentence"]) for i in chunk]
            answers = self._generate(requests)
            tokens += sum(len(r) - len(self.prefix) for r in requests) + sum(len(a) for a in answers)
            for answer_ids in answers:
                answer = self.tokenizer.decode(answer_ids, skip_special_tokens=True)
                results.append({"verdict": parse_verdict(answer), "answer": answer})
        return results, tokens

    @torch.no_grad()
    def _generate(self, requests: list[list[int]]) -> list[list[int]]:
        n = len(self.prefix) if self._prefix_cache is not None and all(
            r[: len(self.prefix)] == self.prefix for r in requests) else 0
        tails = [r[n:] for r in requests]
        width = max(len(t) for t in tails)
        ids = torch.full((len(requests), n + width), self.pad_id, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for row, tail in enumerate(tails):
            ids[row, :n] = torch.tensor(self.prefix[:n], dtype=torch.long) if n else ids[row, :n]
            ids[row, n + width - len(tail) :] = torch.tensor(tail)
            mask[row, :n] = 1
            mask[row, n + width - len(tail) :] = 1
        kwargs = {}
        if n:  # padding sits between the shared prefix and each request's own part
            cache = copy.deepcopy(self._prefix_cache)
            cache.batch_repeat_interleave(len(requests))
            kwargs["past_key_values"] = cache
        device = input_device(self.model)
        out = self.model.generate(input_ids=ids.to(device), attention_mask=mask.to(device),
                                  generation_config=self.config, **kwargs)
        eos = set(self.config.eos_token_id)
        answers = []
        for row in out[:, ids.shape[1] :].tolist():
            end = next((i for i, t in enumerate(row) if t in eos), len(row))
            answers.append(row[:end])
        return answers


def verify_shard(verifier: Verifier, mismatches: list[dict]) -> dict:
    """Verdicts for one shard's mismatches; identical sentence pairs are neutral without a call."""
    start = time.perf_counter()
    to_judge = [m for m in mismatches if not m["identical"]]
    judged, tokens = verifier.judge(to_judge)
    it = iter(judged)
    verdicts = [{"verdict": 0, "answer": None} if m["identical"] else next(it) for m in mismatches]
    return {"verdicts": verdicts, "tokens": tokens, "seconds": time.perf_counter() - start}
