"""Sentence boundaries in token space, and the two sentences a verifier compares at a mismatch.

A sentence-end token is a vocabulary entry of at most four characters that ends in one of
``. 。 ! ！ ? ？`` or a newline, holds no colon and closes every bracket it opens (the R2R
paper's rule), plus any think-tag tokens. Sentences are cut at those tokens, so both sides
of a comparison are cut the same way whatever the language or tokenizer.
"""

from __future__ import annotations

from dataclasses import dataclass

END_CHARS = (".", "。", "!", "！", "?", "？", "\n")
THINK_TAGS = ("<think>", "</think>")
END_OF_ANSWER = "<end of answer>"


def _is_sentence_end(text: str) -> bool:
    if not text or len(text) > 4 or not text.endswith(END_CHARS) or ":" in text:
        return False
    return all(text.count(open_) <= text.count(close) for open_, close in ("()", "[]", "{}"))


def sentence_end_ids(tokenizer) -> frozenset[int]:
    """Ids of the tokens that end a sentence, derived from the tokenizer's vocabulary."""
    size = len(tokenizer)
    texts = tokenizer.batch_decode([[i] for i in range(size)])
    ends = {i for i, text in enumerate(texts) if _is_sentence_end(text)}
    vocab = tokenizer.get_vocab()
    ends |= {vocab[tag] for tag in THINK_TAGS if tag in vocab}
    return frozenset(ends)


def sentence_start(tokens: list[int], index: int, ends: frozenset[int]) -> int:
    """Index where the sentence holding ``tokens[index]`` starts."""
    for i in range(index - 1, -1, -1):
        if tokens[i] in ends:
            return i + 1
    return 0


def through_first_end(tokens: list[int], ends: frozenset[int]) -> list[int]:
    """``tokens`` up to and including the first sentence end (all of them if none)."""
    for i, token in enumerate(tokens):
        if token in ends:
            return tokens[: i + 1]
    return tokens


@dataclass
class Comparison:
    """The two versions of the sentence where the SLM and LLM first differ."""

    context: str
    slm_sentence: str
    llm_sentence: str

    @property
    def identical(self) -> bool:
        return self.slm_sentence.replace("<<", "").replace(">>", "") == self.llm_sentence.replace("<<", "").replace(">>", "")


def compare_sentences(
    tokenizer,
    response: list[int],
    index: int,
    slm_token: int,
    slm_continuation: list[int],
    ends: frozenset[int],
    eos_ids: frozenset[int],
    context_tokens: int,
) -> Comparison:
    """Build both sentences around a mismatch at ``response[index]``.

    Each side runs from the start of the sentence holding the differing token to the first
    sentence end *after* that token, so a differing end token brings the next sentence along.
    The differing token is marked ``<<...>>``; the context is the preceding text of the
    response, cut to its last ``context_tokens`` tokens.

    Args:
        tokenizer: decodes token ids.
        response: the LLM's reference response (token ids).
        index: position of the mismatch in ``response``.
        slm_token: the SLM's token at that position.
        slm_continuation: the LLM's greedy continuation after ``slm_token``.
        ends: sentence-end token ids.
        eos_ids: end-of-answer token ids.
        context_tokens: how much preceding text the verifier sees.
    """
    start = sentence_start(response, index, ends)

    def text(ids: list[int]) -> str:
        body = [t for t in ids if t not in eos_ids]
        out = tokenizer.decode(body)
        return out + (END_OF_ANSWER if len(body) < len(ids) else "")

    def side(token: int, tail: list[int]) -> str:
        return text(response[start:index]) + "<<" + text([token]) + ">>" + text(through_first_end(tail, ends))

    llm_tail = [] if response[index] in eos_ids else response[index + 1 :]
    slm_tail = [] if slm_token in eos_ids else slm_continuation
    return Comparison(
        context=text(response[max(0, start - context_tokens) : start]),
        slm_sentence=side(slm_token, slm_tail),
        llm_sentence=side(response[index], llm_tail),
    )


def mismatch_texts(
    tokenizer, sample: dict, record: dict, ends: frozenset[int], eos_ids: frozenset[int]
) -> dict[str, str]:
    """The texts a verifier reads about one mismatch (``verifiers.base.Mismatch`` fields beyond the sentences).

    Args:
        tokenizer: decodes token ids.
        sample: the step-0 sample (``prompt_ids``, ``response_ids``).
        record: the step-2 mismatch (``position``, ``slm_token``, ``continuation``).
        ends, eos_ids: sentence-end and end-of-answer ids.
    """

    def text(ids: list[int]) -> str:
        return tokenizer.decode([t for t in ids if t not in eos_ids])

    response, j, slm_token = sample["response_ids"], record["position"], record["slm_token"]
    llm_tail = [] if response[j] in eos_ids else through_first_end(response[j + 1 :], ends)
    return {
        "prompt": tokenizer.decode(sample["prompt_ids"]),
        "prefix": text(response[:j]),
        "slm_token": text([slm_token]),
        "llm_token": text([response[j]]),
        "slm": text([slm_token] + record["continuation"]),
        "llm": text([response[j]] + llm_tail),
        "response": text(response),
    }
