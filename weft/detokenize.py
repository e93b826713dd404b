"""Incremental detokenization at O(new tokens) per step.

`new_detokenizer` picks, per tokenizer:
- `ByteLevelDetokenizer` for byte-level BPE tokenizers (GPT-2, Llama 3, Qwen, SmolLM2, ...): each
  token maps to fixed bytes (looked up once per id and cached), and an incremental UTF-8 decoder
  turns the byte stream into text, holding back an incomplete character until its last byte comes.
  No call into the tokenizer per step; the result equals `Tokenizer.decode` of all the tokens.
- `IncrementalDetokenizer` (weft/tokenizer.py) for everything else (sentencepiece's leading
  spaces and byte fallback): it decodes a short window twice per step.
"""

from __future__ import annotations

import weakref
from codecs import utf_8_decode
from collections.abc import Sequence
from functools import cache

from weft.tokenizer import IncrementalDetokenizer, Tokenizer

NUM_PROMPT_CONTEXT_TOKENS = 4  # prompt tokens fed first: an output may complete their last character


@cache
def _byte_of_char() -> dict[str, int]:
    """GPT-2's byte-level alphabet, reversed: the printable character that stands for each byte."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    chars, extra = list(printable), 0
    for byte in range(256):
        if byte not in printable:
            printable.append(byte)
            chars.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(printable, chars, strict=True)}


class TokenBytes:
    """The bytes each token id stands for in a byte-level tokenizer, found once per id."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self.special_ids = {i for i, t in tokenizer.tokenizer.get_added_tokens_decoder().items() if t.special}
        self._cache: dict[int, bytes] = {}

    def __call__(self, token_id: int) -> bytes:
        data = self._cache.get(token_id)
        if data is None:
            text = self.tokenizer.id_to_token(token_id) or ""
            table = _byte_of_char()
            data = b"".join(bytes([table[c]]) if c in table else c.encode() for c in text)
            self._cache[token_id] = data
        return data


_TABLES: weakref.WeakKeyDictionary[Tokenizer, TokenBytes] = weakref.WeakKeyDictionary()


def token_bytes_for(tokenizer: Tokenizer) -> TokenBytes:
    """The one `TokenBytes` table of `tokenizer`, shared by all its sequences."""
    table = _TABLES.get(tokenizer)
    if table is None:
        table = _TABLES[tokenizer] = TokenBytes(tokenizer)
    return table


class ByteLevelDetokenizer:
    """Text of a growing list of byte-level BPE tokens, a few tokens at a time, at O(new tokens).

    The UTF-8 decoding is incremental: `pending` holds the bytes of a character whose last byte has
    not come yet (the state `codecs`' incremental decoder keeps, without its Python-level wrapper:
    this runs once per row per step)."""

    def __init__(
        self, tokenizer: Tokenizer, prompt_ids: Sequence[int], skip_special_tokens: bool = True
    ) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.token_bytes = token_bytes_for(tokenizer)
        self._skip = self.token_bytes.special_ids if skip_special_tokens else frozenset()
        self.pending = b""
        self._decode(self._bytes(prompt_ids[-NUM_PROMPT_CONTEXT_TOKENS:]))  # keeps an unfinished char

    def _bytes(self, token_ids: Sequence[int]) -> bytes:
        skip = self._skip
        return b"".join(self.token_bytes(t) for t in token_ids if t not in skip)

    def _decode(self, data: bytes, final: bool = False) -> str:
        if self.pending:
            data = self.pending + data
        text, used = utf_8_decode(data, "replace", final)
        self.pending = data[used:]
        return text

    def update(self, new_token_ids: Sequence[int]) -> str:
        if len(new_token_ids) == 1:
            return self.update_one(new_token_ids[0])
        return self._decode(self._bytes(new_token_ids))

    def update_one(self, token_id: int) -> str:
        """The text that one more token completes (the common step: one sampled token)."""
        if token_id in self._skip:
            return ""
        data = self.token_bytes(token_id)
        if self.pending:
            return self._decode(data)
        try:
            return data.decode()  # whole characters: no state to keep
        except UnicodeDecodeError:
            return self._decode(data)

    def flush(self) -> str:
        """Whatever is still held back (an incomplete character at the very end), as U+FFFD."""
        return self._decode(b"", final=True)

    def fork(self) -> ByteLevelDetokenizer:
        child = ByteLevelDetokenizer(self.tokenizer, [], self.skip_special_tokens)
        child.pending = self.pending
        return child


def new_detokenizer(
    tokenizer: Tokenizer, prompt_ids: Sequence[int], skip_special_tokens: bool = True
) -> IncrementalDetokenizer | ByteLevelDetokenizer:
    if tokenizer.is_byte_level:
        return ByteLevelDetokenizer(tokenizer, prompt_ids, skip_special_tokens)
    return IncrementalDetokenizer(tokenizer, list(prompt_ids), skip_special_tokens)
