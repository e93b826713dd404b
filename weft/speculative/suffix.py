"""Suffix decoding (Arctic Inference's idea, vLLM's `method: "suffix"`): guesses from what tends to
follow the sequence's last tokens, in its own prompt and output and in the outputs of recent
requests, each continuation weighted by how often it followed.

`SuffixCounts` counts, for every context of 1 .. `depth` tokens, the tokens that followed it. A
guess walks from the sequence's last tokens: at each step the longest context seen before picks
its most frequent next token, whose share of that context's followers multiplies the guess's
probability; the walk stops below `min_token_prob`, after `max_spec_factor` times the matched
length, or at k tokens. The draft length so follows the evidence: a long, often repeated pattern
(an agent's tool call, a JSON record's keys) drafts far; a one-off match drafts a token or two.
Two tables are walked, the sequence's own (`SuffixDrafter`) and the engine's cache of recent
outputs (`SuffixCache`, bounded by requests, oldest out), and the guess that expects more accepted
tokens is taken.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence


class SuffixCounts:
    """Context (a tuple of up to `depth` tokens) -> {next token: count}."""

    __slots__ = ("depth", "follows")

    def __init__(self, depth: int) -> None:
        self.depth = depth
        self.follows: dict[tuple[int, ...], dict[int, int]] = {}

    def add(self, tokens: Sequence[int], start: int = 0, sign: int = 1) -> None:
        """Count each of `tokens[start:]` after the contexts before it (`sign=-1` takes them back)."""
        follows, depth = self.follows, self.depth
        for end in range(max(start, 1), len(tokens)):
            token = tokens[end]
            for n in range(1, min(depth, end) + 1):
                context = tuple(tokens[end - n : end])
                counts = follows.get(context)
                if counts is None:
                    counts = follows[context] = {}
                total = counts.get(token, 0) + sign
                if total > 0:
                    counts[token] = total
                else:
                    counts.pop(token, None)
                    if not counts:
                        del follows[context]

    def walk(
        self, tokens: Sequence[int], k: int, min_prob: float, spec_factor: float
    ) -> tuple[list[int], float]:
        """Up to `k` guesses after `tokens` and their expected number of accepted tokens (the sum of
        the guesses' running probabilities)."""
        context = list(tokens[-self.depth :])
        guessed: list[int] = []
        prob = score = 0.0
        limit = k
        for _ in range(k):
            counts, matched = self._longest(context)
            if counts is None:
                break
            if not guessed:
                prob, limit = 1.0, min(k, max(1, int(spec_factor * matched)))
            token = max(counts, key=counts.__getitem__)
            prob *= counts[token] / sum(counts.values())
            if prob < min_prob or len(guessed) >= limit:
                break
            guessed.append(token)
            score += prob
            context = [*context, token][-self.depth :]
        return guessed, score

    def _longest(self, context: list[int]) -> tuple[dict[int, int] | None, int]:
        for n in range(min(self.depth, len(context)), 0, -1):
            counts = self.follows.get(tuple(context[-n:]))
            if counts:
                return counts, n
        return None, 0


class SuffixCache:
    """The outputs of the most recent `max_requests` sequences, counted (`SuffixCounts`)."""

    def __init__(self, depth: int, max_requests: int) -> None:
        self.counts = SuffixCounts(depth)
        self.max_requests = max_requests
        self._outputs: OrderedDict[int, list[int]] = OrderedDict()  # seq_id -> its output

    def add(self, key: int, output: list[int]) -> None:
        if key in self._outputs or not output or self.max_requests <= 0:
            return
        self._outputs[key] = output
        self.counts.add(output)
        while len(self._outputs) > self.max_requests:
            _, old = self._outputs.popitem(last=False)
            self.counts.add(old, sign=-1)


class SuffixDrafter:
    """A sequence's own counts (prompt and output, fed as they grow) and the shared cache."""

    __slots__ = ("cache", "min_prob", "own", "seen", "spec_factor")

    def __init__(self, cache: SuffixCache, depth: int, min_prob: float, spec_factor: float) -> None:
        self.cache, self.own = cache, SuffixCounts(depth)
        self.min_prob, self.spec_factor = min_prob, spec_factor
        self.seen = 0

    def propose(self, token_ids: Sequence[int], k: int) -> list[int]:
        if self.seen < len(token_ids):
            self.own.add(token_ids, start=self.seen)
            self.seen = len(token_ids)
        own, own_score = self.own.walk(token_ids, k, self.min_prob, self.spec_factor)
        shared, shared_score = self.cache.counts.walk(token_ids, k, self.min_prob, self.spec_factor)
        return own if own_score >= shared_score else shared
