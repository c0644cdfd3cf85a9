"""Decoding generated tokens one at a time into text pieces that concatenate to the full text.

Each new token decodes a short window of the answer, never all of it (the prefix and read offsets of the mature
servers' incremental detokenizers): the tokens not yet handed out as text (from the *read offset*), after those of
the last piece handed out (from the *prefix offset*). The window's text past the prefix's is the new piece. The prefix
is decoded with it because a decoder may treat a text's first token apart (SentencePiece drops its leading space):
both decodes start at the same token, so the difference is what the new tokens add. A piece is held back (the
offsets stay) while it is empty or ends in an incomplete character (a byte-level token inside a multi-byte character
decodes to U+FFFD): the token that completes the character then owns all of it, and every window starts where the
text before it was whole. So the cost per token does not grow with the answer.

A byte-fallback tokenizer (SentencePiece's: Llama 2, Mistral, Gemma, Phi-3) writes a character outside its vocabulary
as byte tokens (``<0xE2>``), and decodes each run of them as a whole: where the run is not valid UTF-8, every byte of
it becomes U+FFFD, the bytes of a whole character before a stray one too. So a piece is also held while the last token
that writes text is a byte token: its run's text is known once a token of another kind follows.

Once the answer ends, ``end`` gives what is still held back (an unfinished character, a U+FFFD the answer's last token
wrote, a byte run, an ending a clean-up may change): ``text + end()`` is ``tokenizer.decode`` of every token.

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
_probed: dict[str, weakref.WeakKeyDictionary] = {"cleans": weakref.WeakKeyDictionary(),
                                                  "bytes": weakref.WeakKeyDictionary()}


class IncrementalText:
    """Text added by each new token, decoded in a window (see the module docstring).

    ``text`` is what was handed out; ``tail`` what the tokens so far add past it that a later token may still change
    (only where the tokenizer cleans up spaces): ``text + tail`` is the decode of every token so far (``decode`` as
    ``tokenizer.decode`` gives it), less a character or byte run still incomplete at the end; ``text + end()`` is all
    of it.

    Args:
        tokenizer: decodes token ids.
        skip_special_tokens: as in ``tokenizer.decode``.
    """

    def __init__(self, tokenizer, skip_special_tokens: bool = True) -> None:
        self.tokenizer, self.skip_special_tokens = tokenizer, skip_special_tokens
        self.cleans = cleans_up(tokenizer)
        self.bytes = byte_tokens(tokenizer)  # (empty but for byte-fallback tokenizers)
        # A skipped special token writes nothing, so it does not end a byte run (the decoder never sees it).
        skipped = self.bytes and skip_special_tokens
        self.skipped = frozenset(getattr(tokenizer, "all_special_ids", ())) if skipped else frozenset()
        self.ids: list[int] = []
        self.text = ""
        self.tail = ""
        self.prefix = self.read = 0  # the window: ids[prefix:read] were handed out last, ids[read:] not yet
        self.prefix_text = ""  # the decode of ids[prefix:read] alone

    def add(self, token: int) -> str | None:
        """The new text ``token`` completes: "" where the tokens since the last piece add none (a skipped special
        token), None while it is held back (an incomplete character, a byte run, or an ending a clean-up may still
        change)."""
        self.ids.append(int(token))
        if self.bytes and self._in_byte_run():
            return None
        window = self._decode(self.ids[self.prefix :])
        if len(window) <= len(self.prefix_text):
            return ""
        if window.endswith("\ufffd"):
            return None
        piece = self._added(window)
        if self.cleans:
            self.tail = piece
            if window.endswith(_UNSETTLED):
                return None
        self.prefix, self.read, self.tail = self.read, len(self.ids), ""
        self.prefix_text = self._decode(self.ids[self.prefix :])
        # (appended in place: ``self.text += piece`` would copy the whole text, 19 us at 25,000 wide characters;
        # CPython grows a string in place when nothing else refers to it)
        text, self.text = self.text, ""
        text += piece
        self.text = text
        return piece

    def end(self) -> str:
        """What every token so far adds past ``text`` now that no more follow (what ``add`` held back included):
        ``text + end()`` is ``tokenizer.decode`` of them all. Hands nothing out (``text`` stays)."""
        return self._added(self._decode(self.ids[self.prefix :]))

    def _added(self, window: str) -> str:
        """What ``window``, the decode of the tokens from ``prefix`` on, adds past the last piece's tokens (cleaned up
        where the tokenizer cleans up: the clean-up of the whole text is the clean-ups of its settled pieces)."""
        if self.cleans:
            clean = self.tokenizer.clean_up_tokenization
            return clean(window)[len(clean(self.prefix_text)) :]
        return window[len(self.prefix_text) :]

    def _in_byte_run(self) -> bool:
        """Whether the last token that writes text (skipped special tokens write none) is a byte token."""
        for token in reversed(self.ids):
            if token not in self.skipped:
                return token in self.bytes
        return False

    def _decode(self, ids: list[int]) -> str:
        if self.cleans:
            return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens,
                                         clean_up_tokenization_spaces=False)
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)


def cleans_up(tokenizer) -> bool:
    """Whether ``tokenizer.decode`` cleans up spaces (seen on a probe text, once per tokenizer): HF's decode skips its
    clean-up for BPE models whatever ``clean_up_tokenization_spaces`` says, so the setting alone does not tell."""

    def probe() -> bool:
        if not (callable(tokenizer) and callable(getattr(tokenizer, "clean_up_tokenization", None))):
            return False  # not an HF tokenizer (a stand-in that only decodes): nothing to clean up
        ids = tokenizer(_PROBE, add_special_tokens=False)["input_ids"]
        return tokenizer.decode(ids) != tokenizer.decode(ids, clean_up_tokenization_spaces=False)

    return _once("cleans", tokenizer, probe)


def byte_tokens(tokenizer) -> frozenset[int]:
    """The ids of a byte-fallback tokenizer's byte tokens (``<0x00>`` ... ``<0xFF>``), or none where ``<0x41>`` is not
    a token that decodes to "A" (a byte-level BPE's bytes are characters of its alphabet instead); once per
    tokenizer."""

    def probe() -> frozenset[int]:
        if not callable(getattr(tokenizer, "convert_tokens_to_ids", None)):
            return frozenset()  # not an HF tokenizer (a stand-in that only decodes)
        ids = tokenizer.convert_tokens_to_ids([f"<0x{b:02X}>" for b in range(256)])
        unknown = getattr(tokenizer, "unk_token_id", None)
        if ids[0x41] in (None, unknown) or tokenizer.decode([ids[0x41]]) != "A":
            return frozenset()
        return frozenset(i for i in ids if i not in (None, unknown))

    return _once("bytes", tokenizer, probe)


def _once(what: str, tokenizer, probe):
    """``probe()``, kept per tokenizer under ``what`` (a tokenizer that cannot be weakly referenced is probed per
    text)."""
    try:
        return _probed[what][tokenizer]
    except (KeyError, TypeError):
        pass
    found = probe()
    try:
        _probed[what][tokenizer] = found
    except TypeError:
        pass
    return found
