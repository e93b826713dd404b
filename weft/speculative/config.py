"""`speculative_config` in vLLM's shape, checked: which proposer, how many tokens it guesses, and
each proposer's own settings."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

METHODS = ("ngram", "suffix")
MAX_SPECULATIVE_TOKENS = 16
DEFAULT_LOOKUP_MIN = 2


@dataclass(frozen=True, slots=True)
class SpeculativeConfig:
    method: str = "ngram"
    num_speculative_tokens: int = 4  # k: tokens guessed per step
    prompt_lookup_min: int = DEFAULT_LOOKUP_MIN  # the shortest n-gram whose earlier occurrence is copied from
    prompt_lookup_max: int = 4  # the longest (tried first)
    # method "suffix" (weft/speculative/suffix.py), vLLM's names; a depth of 8 rather than vLLM's 24:
    # counting every context of a token costs that many dictionary updates, in Python
    suffix_decoding_max_tree_depth: int = 8
    suffix_decoding_max_cached_requests: int = 1000
    suffix_decoding_max_spec_factor: float = 1.0
    suffix_decoding_min_token_prob: float = 0.1

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"speculative_config method {self.method!r}: weft has {', '.join(METHODS)}")
        if not 1 <= self.num_speculative_tokens <= MAX_SPECULATIVE_TOKENS:
            raise ValueError(
                f"speculative_config num_speculative_tokens must be in [1, {MAX_SPECULATIVE_TOKENS}], "
                f"got {self.num_speculative_tokens}"
            )
        self._check_suffix()
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
            raise ValueError(
                "speculative_config needs 1 <= prompt_lookup_min <= prompt_lookup_max, got "
                f"{self.prompt_lookup_min} and {self.prompt_lookup_max}"
            )

    def _check_suffix(self) -> None:
        checks = (
            ("suffix_decoding_max_tree_depth", 1 <= self.suffix_decoding_max_tree_depth <= 64, "in [1, 64]"),
            ("suffix_decoding_max_cached_requests", self.suffix_decoding_max_cached_requests >= 0, ">= 0"),
            ("suffix_decoding_max_spec_factor", self.suffix_decoding_max_spec_factor > 0, "> 0"),
            ("suffix_decoding_min_token_prob", 0 <= self.suffix_decoding_min_token_prob <= 1, "in [0, 1]"),
        )
        for name, ok, rule in checks:
            if not ok:
                raise ValueError(f"speculative_config {name} must be {rule}, got {getattr(self, name)}")

    @classmethod
    def of(cls, fields: Mapping[str, Any]) -> SpeculativeConfig:
        """From a dict as vLLM takes it; an unknown key is an error naming it. Only
        `prompt_lookup_max` given: `prompt_lookup_min` is the default, or the max where that is smaller."""
        unknown = set(fields) - set(cls.__dataclass_fields__)
        if unknown:
            known = ", ".join(cls.__dataclass_fields__)
            raise ValueError(
                f"speculative_config: unknown keys {', '.join(sorted(unknown))}; weft takes {known}"
            )
        values = dict(fields)
        if "prompt_lookup_max" in values and "prompt_lookup_min" not in values:
            values["prompt_lookup_min"] = min(values["prompt_lookup_max"], DEFAULT_LOOKUP_MIN)
        return cls(**values)
