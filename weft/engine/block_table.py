"""Every sequence's block table as one row of a persistent host array.

The KV manager changes a sequence's blocks rarely (a decode row needs a new block once every
`block_size` steps), but every step needs the tables of all its rows. Rebuilding a padded
[B, max_blocks] array from Python lists each step cost about 0.8 us per row; here each table is
written into its own row when it changes, and a step takes its rows with one numpy gather.

Rows are handed out when a sequence first gets blocks and given back when it frees them; the array
grows (doubling rows or columns) when it must. Unused entries are 0, as the padded lists were.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


class BlockTableArray:
    def __init__(self, num_rows: int = 64, num_cols: int = 16) -> None:
        self.array = np.zeros((num_rows, num_cols), dtype=np.int64)  # [rows, max blocks] block ids
        self.lengths = np.zeros(num_rows, dtype=np.int64)  # [rows] valid entries of each row
        self._free = list(range(num_rows - 1, -1, -1))  # popped from the end: row 0 first

    def acquire(self) -> int:
        """A zeroed row for a sequence that gets blocks."""
        if not self._free:
            self._grow_rows()
        return self._free.pop()

    def release(self, row: int) -> None:
        self.array[row, : self.lengths[row]] = 0
        self.lengths[row] = 0
        self._free.append(row)

    def write(self, row: int, block_ids: Sequence[int]) -> None:
        """Row `row` now holds `block_ids` (a table grows, changes a block in place, or loses its tail)."""
        num_blocks = len(block_ids)
        if num_blocks > self.array.shape[1]:
            self._grow_cols(num_blocks)
        old = int(self.lengths[row])
        self.array[row, :num_blocks] = block_ids
        if old > num_blocks:
            self.array[row, num_blocks:old] = 0
        self.lengths[row] = num_blocks

    def gather(self, rows: Sequence[int]) -> np.ndarray:  # [B, longest table] int64
        """The tables of `rows`, in order, padded with block 0 to the longest of them."""
        index = np.fromiter(rows, dtype=np.int64, count=len(rows))
        return self.array[index, : int(self.lengths[index].max(initial=0))]

    def _grow_rows(self) -> None:
        num_rows, num_cols = self.array.shape
        self.array = np.concatenate([self.array, np.zeros((num_rows, num_cols), dtype=np.int64)])
        self.lengths = np.concatenate([self.lengths, np.zeros(num_rows, dtype=np.int64)])
        self._free.extend(range(2 * num_rows - 1, num_rows - 1, -1))

    def _grow_cols(self, needed: int) -> None:
        num_rows, num_cols = self.array.shape
        wider = max(needed, 2 * num_cols)
        self.array = np.concatenate(
            [self.array, np.zeros((num_rows, wider - num_cols), dtype=np.int64)], axis=1
        )
