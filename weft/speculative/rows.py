"""The sampling rows of draft positions.

Verifying k drafts samples k + 1 rows of one sequence in one step: row j is the sequence as if its
first j drafts were appended (its position, output tokens and output count: what the seeded noise,
the penalties, `min_tokens` and the logits processors read), so the token sampled there is the one
the sequence would sample at that position without speculation.
"""

from __future__ import annotations

from weft.params import SamplingParams
from weft.sample.sampler import SamplingRow


class DraftRow:
    """Sequence `base` after its first `depth` drafts (`drafts`, set each step)."""

    __slots__ = ("base", "depth", "drafts")

    def __init__(self, base: SamplingRow, depth: int) -> None:
        self.base, self.depth = base, depth
        self.drafts: list[int] = []

    @property
    def params(self) -> SamplingParams:
        return self.base.params

    @property
    def seed(self) -> int:
        return self.base.seed

    @property
    def num_tokens(self) -> int:
        return self.base.num_tokens + self.depth

    @property
    def num_output_tokens(self) -> int:
        return self.base.num_output_tokens + self.depth

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.base.prompt_token_ids

    @property
    def output_token_ids(self) -> list[int]:
        return self.base.output_token_ids + self.drafts[: self.depth]

    @property
    def eos_token_ids(self) -> frozenset[int]:
        return self.base.eos_token_ids
