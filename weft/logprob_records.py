"""Logprob records: kept as the step's transfer brought them, made into dicts only when read.

A step's logprobs reach the host as one block, [R, 2 + 2 (k+1)] float64 rows of (rank, extra,
k+1 ids, k+1 logprobs) (`weft.sample.transfer.logprob_block`). A sequence keeps, per position, a
`LogprobRef` to its row of that block (with the two numbers it needs at once: the token's logprob
for the cumulative sum, and the extra column), and a `CompletionOutput` holds `LazyPositions`, a
span of those references. The `PositionLogprobs` dicts a user reads are built the first time
`CompletionOutput.logprobs` is read, outside the engine's step: building them (a dict of k+1
named tuples with the tokens' texts, ~2.3 us for top-5) was the biggest host cost of top-n
logprobs, paid per row per step whether or not anyone read them; and the block is 5-30x smaller
than the dicts it stands for.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import NamedTuple

import numpy as np


class Logprob(NamedTuple):
    """The log-probability of one token, its rank in its distribution (1 = most likely) and its text.
    A named tuple: one is made per alternative per position, and this is the cheapest immutable
    record Python has."""

    logprob: float
    rank: int
    decoded_token: str | None = None


# For one position: token id -> Logprob, the chosen token first, then the top-n alternatives.
PositionLogprobs = dict[int, Logprob]


RowLists = tuple[list[int], list[float], int]  # ids [k+1], logprobs [k+1], rank of column 0's token


class LogprobRows:
    """One step's block of logprob rows on the host. It becomes Python lists once, when the first
    of its positions is read (then every row at once: one `tolist` per column group)."""

    __slots__ = ("_array", "_rows")

    def __init__(self, array: np.ndarray | None, rows: list[RowLists] | None = None) -> None:
        self._array = array  # [R, 2 + 2 (k+1)] float64
        self._rows = rows

    def row(self, index: int) -> RowLists:
        """Row `index` as (ids [k+1], logprobs [k+1], rank of column 0's token)."""
        rows = self._rows
        if rows is None:  # (a server's event loop may read while the engine's thread does)
            array = self._array
            rows = self._rows if array is None else _lists(array)  # None: another thread just did
            self._rows, self._array = rows, None  # in this order: a reader always finds one of them
        assert rows is not None
        return rows[index]


def _lists(array: np.ndarray) -> list[RowLists]:
    first = _first_logprob(array)
    ids = array[:, 2:first].astype(np.int64).tolist()
    values = array[:, first:].tolist()
    ranks = array[:, 0].astype(np.int64).tolist()
    return list(zip(ids, values, ranks, strict=True))


def _first_logprob(block: np.ndarray) -> int:
    """The column of column 0's logprob in rows of (rank, extra, k+1 ids, k+1 logprobs)."""
    return 2 + (block.shape[1] - 2) // 2


class LogprobRef(NamedTuple):
    """One position's logprobs: row `row` of `block`; column 0 is the chosen (sampled, forced or
    prompt) token, whose logprob and the row's extra value (the log of the mass a grammar allowed,
    for sampled rows) are here already."""

    block: LogprobRows
    row: int
    logprob: float
    extra: float = 0.0

    @classmethod
    def of(cls, token_ids: list[int], logprobs: list[float], rank: int, extra: float = 0.0) -> LogprobRef:
        """A reference to a one-row block made from lists (tests, scoring)."""
        return cls(LogprobRows(None, [(token_ids, logprobs, rank)]), 0, logprobs[0], extra)

    def lists(self) -> RowLists:
        """(ids [k+1], logprobs [k+1], rank): column 0 first, then the top k."""
        return self.block.row(self.row)

    def position(self, num_top: int, texts: Mapping[int, str]) -> PositionLogprobs:
        ids, values, rank = self.block.row(self.row)
        return position_logprobs(ids, values, rank, num_top, texts)


def row_refs(block: np.ndarray) -> list[LogprobRef]:
    """A reference to each row of a host block [R, 2 + 2 (k+1)], with the chosen token's logprob
    and the extra value read for all rows at once (two column `tolist`s: ~0.1 us a row)."""
    rows = LogprobRows(block)
    chosen, extra = block[:, _first_logprob(block)].tolist(), block[:, 1].tolist()
    items = zip(range(len(chosen)), chosen, extra, strict=True)
    return [_new_ref(LogprobRef, (rows, i, value, more)) for i, value, more in items]


def position_logprobs(
    ids: list[int], values: list[float], rank: int, num_top: int, texts: Mapping[int, str]
) -> PositionLogprobs:
    """One position's logprobs: the actual (or sampled) token first (with its own rank, also when
    it is among the alternatives), then the top `num_top` ranked 1, 2, ... in their order. Records
    are made with `tuple.__new__` (half the time of a named tuple's own constructor), texts from a
    dict, in a plain loop (2.3 us for top-5; map/zip/dict over iterators measured 3.4)."""
    chosen_id = ids[0]
    chosen = _new_logprob(Logprob, (values[0], rank, texts[chosen_id]))
    position: PositionLogprobs = {chosen_id: chosen}
    for i in range(1, min(num_top, len(ids) - 1) + 1):
        token = ids[i]
        position[token] = _new_logprob(Logprob, (values[i], i, texts[token]))
    position[chosen_id] = chosen  # keeps its place first
    return position


_new_logprob = _new_ref = tuple.__new__  # a named tuple from a tuple, without `_make`'s checks


class LazyPositions:
    """Positions `start:end` of a sequence's logprob references, built into `PositionLogprobs`
    when read (`build`). The list is the sequence's own and only grows, so a span of it is a
    snapshot without a copy."""

    __slots__ = ("end", "num_top", "refs", "start", "texts")

    def __init__(
        self, refs: list[LogprobRef], start: int, end: int, num_top: int, texts: Mapping[int, str]
    ) -> None:
        self.refs, self.start, self.end = refs, start, end
        self.num_top, self.texts = num_top, texts

    def build(self) -> list[PositionLogprobs]:
        refs, num_top, texts = self.refs, self.num_top, self.texts
        return [refs[i].position(num_top, texts) for i in range(self.start, self.end)]
