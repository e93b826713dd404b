"""What a sequence reports per output position when logprobs are wanted.

`PositionOutputs` keeps, side by side and always aligned: per position with logprobs, a reference
to its logprob row (`weft.logprob_records`), the log of the mass the constraint allowed and whether
fast-forward appended the token; per output token, where its text starts; and the running sum of
the tokens' logprobs. A sequence that wants no logprobs has none (`Sequence.positions is None`).

Positions with logprobs can trail the output tokens: a token the grammar forced gets its logprobs
when the next step computes it (`Sequence.num_pending_forced`), while its text offset is known at
once. Everything here is appended, forked, sliced for an output and rolled back as one.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from weft.logprob_records import LazyPositions, LogprobRef

# An output's view of the positions: (logprobs, constraint_logmass, text_offsets, forced).
PositionSpan = tuple[LazyPositions, list[float], list[int], list[bool]]


@dataclass(slots=True)
class PositionOutputs:
    records: list[LogprobRef] = field(default_factory=list)  # made PositionLogprobs when read
    constraint_logmass: list[float] = field(default_factory=list)  # per record
    forced: list[bool] = field(default_factory=list)  # per record: appended by fast-forward
    text_offsets: list[int] = field(default_factory=list)  # per output token: where its text starts
    cumulative_logprob: float = 0.0

    def add(self, item: LogprobRef, forced: bool, constrained: bool) -> None:
        """Record one position's logprobs. A sampled row's extra value is the log of the mass the
        constraint allowed; a forced token was the only one fast-forward allowed, so that mass is its
        own probability (0.0 for an unconstrained request)."""
        self.records.append(item)
        logmass = item.logprob if forced else item.extra
        self.constraint_logmass.append(logmass if constrained else 0.0)
        self.forced.append(forced)
        self.cumulative_logprob += item.logprob

    def fork(self) -> PositionOutputs:
        return PositionOutputs(
            list(self.records),
            list(self.constraint_logmass),
            list(self.forced),
            list(self.text_offsets),
            self.cumulative_logprob,
        )

    def span(self, start: int, num_tokens: int, num_top: int, texts: Mapping[int, str]) -> PositionSpan:
        """Positions `start..` for an output: the records so far (built into dicts when read), and
        fresh lists, with the text offsets of the first `num_tokens` output tokens only."""
        records = self.records
        return (
            LazyPositions(records, start, len(records), num_top, texts),
            self.constraint_logmass[start:],
            self.text_offsets[start:num_tokens],
            self.forced[start:],
        )

    def rollback(self, num_tokens: int) -> None:
        """Forget the last `num_tokens` output tokens and whatever was recorded for them (tokens a
        step guessed and the model did not confirm)."""
        if num_tokens <= 0:
            return
        del self.text_offsets[-num_tokens:]
        kept = min(len(self.records), len(self.text_offsets))
        del self.records[kept:], self.constraint_logmass[kept:], self.forced[kept:]
        total = 0.0  # summed again in the same order: the same float as if never appended
        for item in self.records:
            total += item.logprob
        self.cumulative_logprob = total
