"""Per-field confidence for JSON outputs: which tokens wrote each value, and how likely they were.

`field_logprobs(completion)` parses the completion's text as JSON, records the character span of
every leaf value (string, number, true, false, null) under its path (`$.items[2].price`), and sums
the logprobs of the generated tokens whose text overlaps that span. It needs a completion made with
`SamplingParams(logprobs=...)` (any k, with or without a schema).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from weft.outputs import CompletionOutput

_NUMBER = re.compile(r"-?(?:0|[1-9][0-9]*)(?:\.[0-9]+)?(?:[eE][+-]?[0-9]+)?")
_IDENTIFIER = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_LITERALS = {"true": True, "false": False, "null": None}


@dataclass(frozen=True, slots=True)
class FieldLogprobs:
    value: Any  # the leaf's value, as json.loads reads it
    logprob: float  # the sum of the logprobs of the tokens that wrote it
    min_logprob: float  # the least likely of those tokens
    span: tuple[int, int]  # [start, end) in the completion's text (a string's characters, no quotes)
    num_tokens: int


class Fields(dict[str, FieldLogprobs]):
    """`field_logprobs`' answer: path -> FieldLogprobs. `partial` is True when the text ends before
    its JSON value does (a completion cut short by `max_tokens`): then only the leaves written
    whole are here."""

    def __init__(self, partial: bool = False) -> None:
        super().__init__()
        self.partial = partial


def field_logprobs(completion: CompletionOutput) -> Fields:
    """Every JSON leaf of `completion.text` by path, with the logprobs of the tokens that wrote it
    (of a truncated JSON text, the leaves written whole, and `partial` set). Raises ValueError when
    the completion has no logprobs or its text is not JSON (nor the start of a JSON value)."""
    if completion.logprobs is None or completion.text_offsets is None:
        raise ValueError("field_logprobs needs a completion generated with SamplingParams(logprobs=k)")
    text = completion.text
    pairs = zip(completion.token_ids, completion.logprobs, strict=True)
    chosen = [position[token].logprob for token, position in pairs]
    starts = completion.text_offsets
    ends = [*starts[1:], len(text)]
    leaves, partial = _leaf_spans(text)
    fields = Fields(partial)
    for path, (value, start, end) in leaves.items():
        overlapping = [lp for lp, s, e in zip(chosen, starts, ends, strict=False) if s < end and e > start]
        if overlapping:
            fields[path] = FieldLogprobs(
                value, sum(overlapping), min(overlapping), (start, end), len(overlapping)
            )
    return fields


def json_leaf_spans(text: str) -> dict[str, tuple[Any, int, int]]:
    """path -> (value, start, end) for every leaf of the JSON value in `text`."""
    leaves, partial = _leaf_spans(text)
    if partial:
        raise ValueError("completion text is not valid JSON: it ends before its value does")
    return leaves


def _leaf_spans(text: str) -> tuple[dict[str, tuple[Any, int, int]], bool]:
    """The leaves of the JSON value in `text`, and whether the text ends before the value does
    (then: the leaves written whole)."""
    parser = _SpanParser(text)
    try:
        parser.value("$")
    except _Truncated:
        return parser.leaves, True
    parser.skip_space()
    if parser.pos != len(text):
        raise ValueError(f"completion text is not one JSON value: extra text at {parser.pos}")
    return parser.leaves, False


class _Truncated(ValueError):
    """The text ends where the JSON value needs more."""


class _SpanParser:
    """A recursive-descent JSON reader that remembers where each leaf was written."""

    def __init__(self, text: str) -> None:
        self.text, self.pos = text, 0
        self.leaves: dict[str, tuple[Any, int, int]] = {}

    def skip_space(self) -> None:
        while self.pos < len(self.text) and self.text[self.pos] in " \t\r\n":
            self.pos += 1

    def fail(self, what: str) -> ValueError:
        message = f"completion text is not valid JSON: expected {what} at character {self.pos}"
        return _Truncated(message) if self.pos >= len(self.text) else ValueError(message)

    def value(self, path: str) -> None:
        self.skip_space()
        char = self.text[self.pos : self.pos + 1]
        if char == "{":
            return self.object(path)
        if char == "[":
            return self.array(path)
        if char == '"':
            start = self.pos
            value = self.string()
            inner = (start + 1, self.pos - 1) if self.pos - start > 2 else (start, self.pos)
            self.leaves[path] = (value, *inner)
            return None
        return self.scalar(path)

    def scalar(self, path: str) -> None:
        for word, value in _LITERALS.items():
            if self.text.startswith(word, self.pos):
                self.leaves[path] = (value, self.pos, self.pos + len(word))
                self.pos += len(word)
                return
        match = _NUMBER.match(self.text, self.pos)
        if match is None:
            rest = self.text[self.pos :]
            if rest and any(word.startswith(rest) for word in _LITERALS):
                self.pos = len(self.text)  # "tru": the text ends inside a literal
            raise self.fail("a value")
        self.leaves[path] = (json.loads(match.group()), match.start(), match.end())
        self.pos = match.end()

    def string(self) -> str:
        start = self.pos
        self.pos += 1
        while self.pos < len(self.text) and self.text[self.pos] != '"':
            self.pos += 2 if self.text[self.pos] == "\\" else 1
        if self.pos >= len(self.text):
            raise self.fail("the end of a string")
        self.pos += 1
        return str(json.loads(self.text[start : self.pos]))

    def object(self, path: str) -> None:
        self.pos += 1
        self.skip_space()
        if self.text.startswith("}", self.pos):
            self.pos += 1
            return
        while True:
            self.skip_space()
            if not self.text.startswith('"', self.pos):
                raise self.fail("a key")
            key = self.string()
            self.skip_space()
            if not self.text.startswith(":", self.pos):
                raise self.fail("':'")
            self.pos += 1
            self.value(f"{path}.{key}" if _IDENTIFIER.fullmatch(key) else f"{path}[{json.dumps(key)}]")
            if not self.separator("}"):
                return

    def array(self, path: str) -> None:
        self.pos += 1
        self.skip_space()
        if self.text.startswith("]", self.pos):
            self.pos += 1
            return
        index = 0
        while True:
            self.value(f"{path}[{index}]")
            index += 1
            if not self.separator("]"):
                return

    def separator(self, closing: str) -> bool:
        """After an item: True at ',' (another item follows), False at the closing bracket."""
        self.skip_space()
        char = self.text[self.pos : self.pos + 1]
        if char not in (",", closing) or not char:
            raise self.fail(f"',' or '{closing}'")
        self.pos += 1
        return char == ","
