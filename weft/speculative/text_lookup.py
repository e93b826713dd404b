"""Prompt lookup on the text, for what token-level lookup misses: the same words tokenized
differently where they are copied (` Menenius` in a record, `Menenius` inside a JSON string).

The sequence's text is kept as bytes (a byte-level tokenizer's tokens stand for fixed bytes); a
guess takes the last `max_bytes` .. `min_bytes` bytes, finds their latest earlier occurrence, and
tokenizes the `span` bytes that followed it. Tokenizing costs tens of microseconds, so
`NgramDrafter` asks this only when the token-level index has no match. The same text answers for
the value a JSON key names (`named_value`), which the drafter asks first.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from weft.detokenize import TokenBytes
from weft.speculative.field_lookup import named_value, states_fields


class TextLookup:
    __slots__ = ("encode", "max_bytes", "min_bytes", "num_tokens", "span", "stated", "text", "token_bytes")

    def __init__(
        self,
        token_bytes: TokenBytes,
        encode: Callable[[str], list[int]],
        min_bytes: int = 4,
        max_bytes: int = 16,
        span: int = 48,
    ) -> None:
        self.token_bytes, self.encode = token_bytes, encode
        self.min_bytes, self.max_bytes, self.span = min_bytes, max_bytes, span
        self.text = bytearray()
        self.num_tokens = 0  # how many of the sequence's tokens `text` holds
        self.stated: bool | None = None  # whether the text first read (the prompt) states fields

    def update(self, token_ids: Sequence[int]) -> None:
        """Read the tokens appended since the last call."""
        for token in token_ids[self.num_tokens :]:
            self.text += self.token_bytes(token)
        self.num_tokens = len(token_ids)

    def states_fields(self, token_ids: Sequence[int]) -> bool:
        """Whether the sequence's text as first read (its prompt) states `key: value` lines, which
        `named_value` drafts from."""
        if self.stated is None:
            self.update(token_ids)
            self.stated = states_fields(self.text)
        return self.stated

    def named_value(self, token_ids: Sequence[int], k: int) -> list[int]:
        """Up to `k` tokens of the value that the text states for the JSON key whose value it has
        just opened (`weft/speculative/field_lookup.py`), or []."""
        return self.named_value_after(token_ids, (), k)

    def named_value_after(self, token_ids: Sequence[int], draft: Sequence[int], k: int) -> list[int]:
        """`named_value` for the text followed by `draft`'s tokens, which are not read in."""
        self.update(token_ids)
        text = self.text + b"".join(self.token_bytes(token) for token in draft) if draft else self.text
        value = named_value(text)
        return self.encode(value)[:k] if value else []

    def propose(self, token_ids: Sequence[int], k: int) -> list[int]:
        self.update(token_ids)
        text, end = self.text, len(self.text)
        for size in range(min(self.max_bytes, end - 1), self.min_bytes - 1, -1):
            start = text.rfind(text[end - size :], 0, end - 1)
            if start >= 0:
                follows = bytes(text[start + size : start + size + self.span])
                return self.encode(follows.decode("utf-8", errors="ignore"))[:k] if follows else []
        return []
