"""A sequence's text: its detokenizer, its stop strings, the text so far, and what was handed out.

`TextState` turns the output tokens into text as they come (`decode_one`, `decode`, `decode_each`),
adds it (`extend`: O(new text), with the stop strings matched across token boundaries), and
remembers how much of the output has been handed out already (`sent`, for DELTA outputs).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace

from weft.detokenize import ByteLevelDetokenizer, new_detokenizer
from weft.params import SamplingParams
from weft.tokenizer import IncrementalDetokenizer, StopMatch, StopStringMatcher, Tokenizer, TokenTexts


@dataclass(slots=True)
class OutputCursor:
    """How much of a sequence's output has been handed out already (for DELTA outputs)."""

    num_chars: int = 0
    num_tokens: int = 0
    num_logprobs: int = 0


@dataclass(slots=True)
class TextState:
    detokenizer: IncrementalDetokenizer | ByteLevelDetokenizer
    stop_matcher: StopStringMatcher
    text: str = ""
    sent: OutputCursor = field(default_factory=OutputCursor)

    @classmethod
    def create(
        cls, tokenizer: Tokenizer, prompt_token_ids: Sequence[int], params: SamplingParams
    ) -> TextState:
        return cls(
            new_detokenizer(tokenizer, prompt_token_ids, params.skip_special_tokens),
            StopStringMatcher(params.stop, params.include_stop_str_in_output),
        )

    def fork(self) -> TextState:
        return TextState(self.detokenizer.fork(), self.stop_matcher, self.text, replace(self.sent))

    @property
    def token_texts(self) -> TokenTexts:
        return self.detokenizer.tokenizer.token_texts

    def decode_one(self, token_id: int) -> str:
        return self.detokenizer.update_one(token_id)

    def decode(self, token_ids: list[int]) -> str:
        return self.detokenizer.update(token_ids)

    def decode_each(self, token_ids: list[int], offsets: list[int]) -> str:
        """The new tokens' text, recording where each token's text starts (for logprobs)."""
        if len(token_ids) == 1:
            offsets.append(len(self.text))
            return self.detokenizer.update_one(token_ids[0])
        parts, end = [], len(self.text)
        for token in token_ids:
            offsets.append(end)
            parts.append(self.detokenizer.update([token]))
            end += len(parts[-1])
        return "".join(parts)

    def extend(self, new_text: str, finishing: bool) -> StopMatch | None:
        """Add the text of new tokens (with what the detokenizer held back, at a finish). Returns the
        first stop string in the text, if one now matches (the caller cuts the text at it)."""
        if finishing:
            new_text += self.detokenizer.flush()
        if not new_text:
            return None
        # O(new text): with the attribute dropped first, the local is the string's only reference
        # and CPython extends it in place (`self.text += new_text` copies all the text so far).
        text, self.text = self.text, ""
        text += new_text
        self.text = text
        if not self.stop_matcher.stops:
            return None
        return self.stop_matcher.check(text, len(new_text))

    def ready_chars(self) -> int:
        """How many characters can be handed out while a stop string may still match: all but those
        that could be the start of one (never fewer than were handed out already)."""
        return max(self.sent.num_chars, len(self.text) - self.stop_matcher.holdback)
