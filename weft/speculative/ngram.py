"""Prompt lookup: guess that the text continues as it did after the last earlier occurrence of its
final n tokens (n from `max_n` down to `min_n`, the longest match first).

`NgramIndex` keeps, per sequence, every n-gram's latest earlier end, updated as tokens are
appended: O(max_n - min_n + 1) dictionary writes per token and as many reads per guess, a few
microseconds a row whatever the sequence's length.
"""

from __future__ import annotations

from collections.abc import Iterable


class NgramIndex:
    def __init__(self, min_n: int, max_n: int, tokens: Iterable[int] = ()) -> None:
        assert 1 <= min_n <= max_n
        self.min_n, self.max_n = min_n, max_n
        self.tokens: list[int] = []
        # n-gram -> where its latest occurrence was followed (the index of the next token)
        self._follows: dict[tuple[int, ...], int] = {}
        self.extend(tokens)

    def extend(self, tokens: Iterable[int]) -> None:
        seq, follows = self.tokens, self._follows
        for token in tokens:
            end = len(seq)  # the n-grams ending just before `token` are followed at `end`
            for n in range(self.min_n, min(self.max_n, end) + 1):
                follows[tuple(seq[end - n : end])] = end
            seq.append(token)

    def propose(self, k: int) -> list[int]:
        """Up to `k` tokens after the latest earlier occurrence of the longest matching suffix;
        [] when no suffix of `min_n` or more tokens occurred before. A match that runs into the
        suffix itself repeats with its period (`a b c a b c` guesses `a b c ...`)."""
        seq = self.tokens
        length = len(seq)
        for n in range(min(self.max_n, length), self.min_n - 1, -1):
            start = self._follows.get(tuple(seq[length - n :]))
            if start is not None:
                period = length - start
                return [seq[start + i % period] for i in range(k)]
        return []
