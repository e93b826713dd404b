"""The llguidance mask engine behind weft's grammar protocol.

llguidance (Rust) compiles JSON Schema, regex and Lark/GBNF grammars lazily against the tokenizer's
token trie; a mask costs tens of microseconds, and `fill_next_token_bitmask_par` fills a whole
batch on native threads without the GIL. Each spec is compiled once into a template matcher; a
sequence's matcher is a `deep_copy` of it.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, cast

import llguidance
import torch

from weft.params import StructuredKind, StructuredSpec
from weft.structured.grammar import GrammarError, GrammarMatcher

if TYPE_CHECKING:
    from llguidance._lib import JsonCompileOptions

_FORMAT = {
    StructuredKind.REGEX: "regex",
    StructuredKind.LARK: "lark",
    StructuredKind.GBNF: "gbnf",
    StructuredKind.CHOICE: "choice",
}

# JSON is written like Python's json.dumps: ", " and ": " separators and no other whitespace. More
# bytes are then forced (fast-forward), and a model cannot loop on whitespace.
JSON_STYLE: JsonCompileOptions = {
    "whitespace_flexible": False,
    "item_separator": ", ",
    "key_separator": ": ",
}


@dataclass(frozen=True, slots=True)
class LLGuidanceGrammar:
    spec: StructuredSpec
    template: llguidance.LLMatcher


class LLGuidanceMatcher:
    def __init__(self, matcher: llguidance.LLMatcher) -> None:
        self.matcher = matcher

    @property
    def error(self) -> str | None:
        return self.matcher.get_error() if self.matcher.is_error() else None

    @property
    def is_finished(self) -> bool:
        return bool(self.matcher.is_stopped())

    def consume(self, token_ids: Sequence[int]) -> bool:
        if len(token_ids) == 1:  # a sampled token: the common case
            return bool(self.matcher.consume_token(token_ids[0]))
        return bool(self.matcher.consume_tokens(list(token_ids)))

    def rollback(self, num_tokens: int) -> None:
        self.matcher.rollback(num_tokens)

    def validate(self, token_ids: Sequence[int]) -> int:
        return int(self.matcher.validate_tokens(list(token_ids)))

    def forced_tokens(self) -> list[int]:
        return list(self.matcher.compute_ff_tokens())

    def fork(self) -> LLGuidanceMatcher:
        return LLGuidanceMatcher(self.matcher.deep_copy())


class LLGuidanceBackend:
    def __init__(
        self,
        tokenizer_json: str,
        vocab_size: int,
        eos_token_ids: Sequence[int],
        num_threads: int | None = None,
    ) -> None:
        """`tokenizer_json`: the tokenizer.json text; `vocab_size`: the model's (it may exceed the
        tokenizer's; the extra ids are never allowed)."""
        self.vocab_size = vocab_size
        self.tokenizer = llguidance.LLTokenizer(
            tokenizer_json, n_vocab=vocab_size, eos_token=list(eos_token_ids)
        )
        self.executor = llguidance.LLExecutor(num_threads)

    def compile(self, spec: StructuredSpec) -> LLGuidanceGrammar:
        try:
            if spec.kind == StructuredKind.JSON_SCHEMA:
                grammar = llguidance.LLMatcher.grammar_from_json_schema(spec.value, defaults=JSON_STYLE)
            else:
                grammar = llguidance.grammar_from(_FORMAT[spec.kind], spec.value)  # type: ignore[arg-type]
        except (ValueError, json.JSONDecodeError) as exc:
            raise GrammarError(f"invalid {spec.kind.value}: {exc}") from None
        is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar, self.tokenizer)
        if is_error:
            raise GrammarError(f"invalid {spec.kind.value}: {messages[0]}")
        template = llguidance.LLMatcher(self.tokenizer, grammar, log_level=0)
        if template.is_error():
            raise GrammarError(f"invalid {spec.kind.value}: {template.get_error()}")
        return LLGuidanceGrammar(spec, template)

    def new_matcher(self, grammar: object) -> LLGuidanceMatcher:
        return LLGuidanceMatcher(cast(LLGuidanceGrammar, grammar).template.deep_copy())

    def fill_bitmask(
        self, matchers: Sequence[tuple[GrammarMatcher, int, Sequence[int]]], bitmask: torch.Tensor
    ) -> None:
        """Fill rows of `bitmask` ([R, W] int32, contiguous, on CPU) in parallel, without the GIL;
        a matcher with drafts fills the rows after its own with the masks after each draft
        (llguidance consumes them and rolls them back).

        Calls the executor directly: `llguidance.torch`, which wraps this call, would import
        torch's compiler stack (seconds of start-up) for a kernel weft does not use."""
        assert bitmask.dtype == torch.int32 and bitmask.is_contiguous() and bitmask.device.type == "cpu"
        rows, words = bitmask.shape
        pairs = [(cast(LLGuidanceMatcher, m).matcher, idx) for m, idx, d in matchers if not d]
        if len(pairs) < len(matchers):  # llguidance takes the rows with drafts in a call of their own
            items = [(cast(LLGuidanceMatcher, m).matcher, idx, list(d)) for m, idx, d in matchers if d]
            self.executor.unsafe_compute_mask_ptr_with_draft_token(items, bitmask.data_ptr(), words * 4, rows)
        if pairs:
            self.executor.unsafe_compute_mask_ptr(pairs, bitmask.data_ptr(), words * 4, rows)
