"""Decoding generated tokens one at a time into text pieces that concatenate to the full text."""

from __future__ import annotations


class IncrementalText:
    """Text added by each new token, holding back a token that ends inside a multi-byte character.

    Pieces are differences between decodes of growing prefixes, so they always concatenate to the
    decode of all tokens; the token that completes a character owns the whole character.

    Args:
        tokenizer: decodes token ids.
        skip_special_tokens: as in ``tokenizer.decode``.
    """

    def __init__(self, tokenizer, skip_special_tokens: bool = True) -> None:
        self.tokenizer, self.skip_special_tokens = tokenizer, skip_special_tokens
        self.ids: list[int] = []
        self.text = ""

    def add(self, token: int) -> str | None:
        """The new text ``token`` completes; None while a character is still incomplete."""
        self.ids.append(int(token))
        text = self.tokenizer.decode(self.ids, skip_special_tokens=self.skip_special_tokens)
        if text.endswith("\ufffd"):
            return None
        piece, self.text = text[len(self.text):], text
        return piece
