"""Decoding generated tokens one at a time into text pieces that concatenate to the full text.

Each new token decodes a short window of the answer, never all of it (the prefix and read offsets of the mature
servers' incremental detokenizers): the tokens not yet handed out as text (from the *read offset*), after those of
the last piece handed out (from the *prefix offset*). The window's text past the prefix's is the new piece. The prefix
is decoded with it because a decoder may treat a text's first token apart (SentencePiece drops its leading space):
both decodes start at the same token, so the difference is what the new tokens add. A piece is held back (the
offsets stay) while it is empty or ends in an incomplete character (a byte-level token inside a multi-byte character
decodes to U+FFFD): the token that completes the character then owns all of it, and every window starts where the
text before it was whole. So the cost per token does not grow with the answer.

Where the tokenizer cleans up spaces on decode (``clean_up_tokenization_spaces``: " ." becomes ".", " n't" "n't"), the
windows are decoded without it and the clean-up runs on the pieces: a piece is held back while its text ends where a
clean-up could still begin (``_UNSETTLED``), since the clean-up of a whole text is then the clean-ups of its pieces.
"""

from __future__ import annotations

import weakref

# A text ending in one of these may still change when more follows (HF's ``clean_up_tokenization`` removes the space
# before ". ? ! ," and before "n't 'm 's 've 're", and both spaces around " ' "): the proper prefixes of its patterns.
_UNSETTLED = (" ", " '", " n", " n'", " 'v", " 'r")
_PROBE = "a . b ? c ! d , e ' f n't g 'm h 's i 've j 're k"
_cleaners: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


class IncrementalText:
    """Text added by each new token, decoded in a window (see the module docstring).

    ``text`` is what was handed out; ``tail`` what the tokens so far add past it that a later token may still change
    (only where the tokenizer cleans up spaces): ``text + tail`` is the decode of every token so far (``decode`` as
    ``tokenizer.decode`` gives it), less a character still incomplete at the end.

    Args:
        tokenizer: decodes token ids.
        skip_special_tokens: as in ``tokenizer.decode``.
    """

    def __init__(self, tokenizer, skip_special_tokens: bool = True) -> None:
        self.tokenizer, self.skip_special_tokens = tokenizer, skip_special_tokens
        self.cleans = cleans_up(tokenizer)
        self.ids: list[int] = []
        self.text = ""
        self.tail = ""
        self.prefix = self.read = 0  # the window: ids[prefix:read] were handed out last, ids[read:] not yet
        self.prefix_text = ""  # the decode of ids[prefix:read] alone

    def add(self, token: int) -> str | None:
        """The new text ``token`` completes: "" where the tokens since the last piece add none (a skipped special
        token), None while it is held back (an incomplete character, or an ending a clean-up may still change)."""
        self.ids.append(int(token))
        window = self._decode(self.ids[self.prefix :])
        if len(window) <= len(self.prefix_text):
            return ""
        if window.endswith("\ufffd"):
            return None
        if self.cleans:
            clean = self.tokenizer.clean_up_tokenization
            self.tail = clean(window)[len(clean(self.prefix_text)) :]
            if window.endswith(_UNSETTLED):
                return None
        piece = self.tail if self.cleans else window[len(self.prefix_text) :]
        self.prefix, self.read, self.tail = self.read, len(self.ids), ""
        self.prefix_text = self._decode(self.ids[self.prefix :])
        # (appended in place: ``self.text += piece`` would copy the whole text, 19 us at 25,000 wide characters;
        # CPython grows a string in place when nothing else refers to it)
        text, self.text = self.text, ""
        text += piece
        self.text = text
        return piece

    def _decode(self, ids: list[int]) -> str:
        if self.cleans:
            return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens,
                                         clean_up_tokenization_spaces=False)
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)


def cleans_up(tokenizer) -> bool:
    """Whether ``tokenizer.decode`` cleans up spaces (seen on a probe text, once per tokenizer): HF's decode skips its
    clean-up for BPE models whatever ``clean_up_tokenization_spaces`` says, so the setting alone does not tell."""
    try:
        return _cleaners[tokenizer]
    except (KeyError, TypeError):
        pass
    if not (callable(tokenizer) and callable(getattr(tokenizer, "clean_up_tokenization", None))):
        return False  # not an HF tokenizer (a stand-in that only decodes): nothing to clean up
    ids = tokenizer(_PROBE, add_special_tokens=False)["input_ids"]
    cleans = tokenizer.decode(ids) != tokenizer.decode(ids, clean_up_tokenization_spaces=False)
    try:
        _cleaners[tokenizer] = cleans
    except TypeError:  # (a tokenizer that cannot be weakly referenced is probed per text)
        pass
    return cleans
