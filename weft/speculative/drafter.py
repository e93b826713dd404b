"""What a sequence keeps for speculation: its proposer and its counts.

A `Drafter` guesses the next tokens of one sequence from the tokens it holds; `DraftState` is what
the engine's speculation keeps of one sequence (`Speculation.states`, by seq_id): its drafter,
built on first use, and how many drafts it made and how many of their tokens were accepted.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from weft.config import SpeculativeConfig
from weft.detokenize import token_bytes_for
from weft.outputs import SpeculationCounts
from weft.sample.sampler import SamplingRow
from weft.speculative.ngram import NgramIndex
from weft.speculative.policy import Acceptance
from weft.speculative.rows import DraftRow
from weft.speculative.suffix import SuffixCache, SuffixDrafter
from weft.speculative.text_lookup import TextLookup
from weft.tokenizer import Tokenizer


class Drafter(Protocol):
    def propose(self, token_ids: Sequence[int], k: int) -> list[int]:
        """Up to `k` guesses of the tokens after `token_ids` (the sequence's tokens so far: earlier
        calls saw a prefix of them)."""
        ...


# A drafter may also guess past tokens a grammar forces (`propose_after(token_ids, draft, k)`,
# weft/speculative/forced.py); `NgramDrafter` does, for the values a prompt states.


class NgramDrafter:
    """Prompt lookup (`NgramIndex`) over the sequence's prompt and output, fed the tokens appended
    since the last guess; where it has no match and the tokenizer is byte-level, the same lookup on
    the text (`TextLookup`). With a byte-level tokenizer, where the output has just opened a JSON
    key's value that the prompt states (`home: verona`), that value comes first
    (`weft/speculative/field_lookup.py`)."""

    __slots__ = ("index", "text")

    def __init__(self, min_n: int, max_n: int, text: TextLookup | None = None) -> None:
        self.index = NgramIndex(min_n, max_n)
        self.text = text

    def propose(self, token_ids: Sequence[int], k: int) -> list[int]:
        seen = len(self.index.tokens)
        if seen < len(token_ids):
            self.index.extend(token_ids[seen:])
        if self.text is not None:  # a JSON value just opened, stated in the prompt: that value
            guessed = self.text.named_value(token_ids, k)
            if guessed:
                return guessed
        guessed = self.index.propose(k)
        if not guessed and self.text is not None:
            guessed = self.text.propose(token_ids, k)
        return guessed

    def states_fields(self, token_ids: Sequence[int]) -> bool:
        """Whether the prompt states `key: value` lines that JSON values may restate (an
        extraction: its value guesses are drafted whatever the step gate says, Speculation.propose)."""
        return self.text is not None and self.text.states_fields(token_ids)

    def propose_after(self, token_ids: Sequence[int], draft: list[int], k: int) -> list[int]:
        """Up to `k` guesses after `token_ids` and then `draft` (tokens a grammar forces, after
        guesses: weft/speculative/forced.py), without reading `draft` in: the value a JSON key
        that `draft` opens names in the prompt, or []."""
        return self.text.named_value_after(token_ids, draft, k) if self.text is not None else []


DrafterFactory = Callable[[], Drafter]


def drafter_factory(
    config: SpeculativeConfig, tokenizer: Tokenizer | None = None, cache: SuffixCache | None = None
) -> DrafterFactory:
    """A new drafter per sequence, of the configured method: prompt lookup (with text lookup where
    `tokenizer` is byte-level), or suffix decoding over the sequence and `cache`."""
    if config.method == "suffix":
        assert cache is not None, "suffix decoding needs the engine's cache of recent outputs"
        depth, spec_factor = config.suffix_decoding_max_tree_depth, config.suffix_decoding_max_spec_factor
        min_prob = config.suffix_decoding_min_token_prob
        return lambda: SuffixDrafter(cache, depth, min_prob, spec_factor)
    min_n, max_n = config.prompt_lookup_min, config.prompt_lookup_max
    if tokenizer is None or not tokenizer.is_byte_level:
        return lambda: NgramDrafter(min_n, max_n)
    token_bytes = token_bytes_for(tokenizer)

    def encode(text: str) -> list[int]:
        return tokenizer.encode(text, add_special_tokens=False)

    return lambda: NgramDrafter(min_n, max_n, TextLookup(token_bytes, encode))


@dataclass(slots=True)
class Tally:
    """Drafts made, their tokens, and the tokens accepted: of one sequence, or of an engine."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_forced_kept: int = 0  # tokens a grammar forced that drafts held and verification kept

    def add(self, num_draft_tokens: int, num_accepted: int, num_forced_kept: int = 0) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted
        self.num_forced_kept += num_forced_kept

    @property
    def counts(self) -> SpeculationCounts:
        return SpeculationCounts(self.num_drafts, self.num_draft_tokens, self.num_accepted_tokens)


@dataclass(slots=True)
class DraftState:
    """One sequence's speculation: its drafter, its tally and its engine's, and its acceptance
    estimate (weft/speculative/policy.py)."""

    drafter: Drafter
    engine_tally: Tally
    tally: Tally = field(default_factory=Tally)
    acceptance: Acceptance = field(default_factory=Acceptance)
    engine_acceptance: Acceptance | None = None  # the engine's, over all its sequences
    rows: list[DraftRow] = field(default_factory=list)  # its draft positions' sampling rows, reused

    def draft_rows(
        self, base: SamplingRow, drafts: list[int], rowless: tuple[int, ...] = ()
    ) -> list[DraftRow]:
        """The sampling rows of `base`'s draft positions this step, but for the `rowless` ones (the
        same objects step after step, so that the sampler's columns are rebuilt only when the rows
        change)."""
        rows = self.rows
        while len(rows) < len(drafts):
            rows.append(DraftRow(base, len(rows) + 1))
        for row in rows[: len(drafts)]:
            row.drafts = drafts
        if rowless:  # row j samples after j drafts: none where drafts[j] is forced
            return [row for row in rows[: len(drafts)] if row.depth not in rowless]
        return rows[: len(drafts)]

    def record(self, num_draft_tokens: int, num_accepted: int, num_forced_kept: int = 0) -> None:
        """One verification: `num_draft_tokens` guesses, the first `num_accepted` of them
        accepted, and `num_forced_kept` forced tokens among them kept (weft/speculative/forced.py)."""
        self.tally.add(num_draft_tokens, num_accepted, num_forced_kept)
        self.acceptance.record(num_draft_tokens, num_accepted)
        self.engine_tally.add(num_draft_tokens, num_accepted, num_forced_kept)
        if self.engine_acceptance is not None:
            self.engine_acceptance.record(num_draft_tokens, num_accepted)
