"""The sliding-window layers' own KV blocks, given back as the window passes them.

A query at position p of a sliding-window layer reads the keys p - W + 1 .. p only (W: the window).
Where a model has such layers beside layers that read every key (Gemma 2/3, gpt-oss) or only such
layers (Mistral with a window), the sliding layers keep their keys and values in a pool of their
own: a sequence holds blocks there for the last W positions and the ones it writes next, and each
block that falls wholly behind the window of the next position it computes goes back to the pool.
A long sequence then costs the layers that read everything plus a window's worth of the others.

The table of a sequence here is indexed like its table in the main pool (logical block i holds
positions i * block_size ..), with the blocks behind the window replaced by the scratch block
(`null`, zero-filled and never written): the attention kernels start at the window and never read
those entries; the masked torch path reads zeros. Full blocks are registered under the main pool's
hash chain, so a prefix-cache hit also finds the window before it; a freed block keeps its hash
until the pool reuses it, as in the main pool.

Positions a sequence computes only grow (speculation gives back drafts past its computed tokens,
preemption gives back everything), so a block given back is never needed again by that sequence;
a fork shares only a parent whose blocks still cover the fork's window (`covers`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from weft.engine.block_table import BlockTableArray
from weft.engine.kv_blocks import Block, BlockPool


@dataclass(slots=True)
class WindowTable:
    """One sequence's blocks in the window pool: None behind the window."""

    blocks: list[Block | None] = field(default_factory=list)
    first_held: int = 0  # every entry before it is None
    row: int = -1  # its row of `WindowBlocks.block_tables`

    def block_ids(self, null: int) -> list[int]:
        return [null if b is None else b.block_id for b in self.blocks]


class WindowBlocks:
    """The window pool's bookkeeping, driven by `KVCacheManager` beside the main pool."""

    def __init__(self, num_blocks: int, block_size: int, window: int) -> None:
        self.pool = BlockPool(num_blocks)
        self.block_size = block_size
        self.window = window
        self.null = num_blocks  # the scratch block (one past the pool) behind the window
        self.tables: dict[int, WindowTable] = {}
        self.block_tables = BlockTableArray()
        self.pending_copies: list[tuple[int, int]] = []

    @property
    def num_blocks(self) -> int:
        return len(self.pool.blocks)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.pool.num_free

    def first_needed(self, position: int) -> int:
        """The first block a query at `position` (or later) reads."""
        return max(0, position - self.window + 1) // self.block_size

    def row(self, seq_id: int) -> int:
        return self.tables[seq_id].row

    # -- the prefix cache ----------------------------------------------------------------------

    def hits(self, hashes: list[int], tokens: list[tuple[int, ...]]) -> tuple[int, list[Block]]:
        """The longest prefix of the main pool's hits (`hashes`, the chain of its first blocks,
        and their `tokens`) whose window this pool still holds: (its number of blocks k, the
        blocks first_needed(k * block_size) .. k - 1)."""
        for k in range(len(hashes), 0, -1):
            first = self.first_needed(k * self.block_size)
            found = [self.pool.lookup(hashes[i], tokens[i]) for i in range(first, k)]
            if all(b is not None for b in found):
                return k, [b for b in found if b is not None]
        return 0, []

    def register(self, seq_id: int, index: int, block_hash: int, token_ids: tuple[int, ...]) -> None:
        """The sequence's full block `index` is computed: cache it under the main pool's hash."""
        table = self.tables[seq_id]
        block = table.blocks[index] if index < len(table.blocks) else None
        if block is not None:
            self.pool.register(block, block_hash, token_ids)

    # -- a sequence's blocks -------------------------------------------------------------------

    def needed(self, seq_id: int, start: int, end: int, hits: list[Block]) -> int:
        """Free blocks `grow` takes to write positions start .. end - 1 (after prefix hits)."""
        table = self.tables.get(seq_id)
        num_blocks = len(table.blocks) if table is not None else start // self.block_size
        num_new = max(0, -(-end // self.block_size) - num_blocks)
        write = start // self.block_size
        shared = table is not None and write < len(table.blocks) and _shared(table.blocks[write])
        return num_new + int(shared) + sum(1 for b in hits if b.ref_cnt == 0)

    def ready(self, seq_id: int, start: int, end: int) -> bool:
        """Whether the sequence writes start .. end - 1 into blocks it holds alone (after giving
        back those behind the window of `start`)."""
        table = self.tables.get(seq_id)
        if table is None or end > len(table.blocks) * self.block_size:
            return False
        if self._pass(table, start):
            self._write(table)
        write = start // self.block_size
        return write >= len(table.blocks) or not _shared(table.blocks[write])

    def grow(self, seq_id: int, start: int, end: int, hits: list[Block]) -> None:
        """Blocks for positions start .. end - 1 (`needed` of them free): prefix hits (the window
        before `start`), new blocks, a private copy of a shared block written into."""
        table = self.tables.get(seq_id)
        if table is None:
            table = WindowTable(row=self.block_tables.acquire())
            self.tables[seq_id] = table
            behind = start // self.block_size - len(hits)
            table.blocks = [None] * behind
            table.first_held = behind
            for block in hits:
                self.pool.touch(block)
            table.blocks += hits
        num_new = max(0, -(-end // self.block_size) - len(table.blocks))
        table.blocks += [self.pool.allocate() for _ in range(num_new)]
        write = start // self.block_size
        shared = table.blocks[write] if write < len(table.blocks) else None
        if shared is not None and shared.ref_cnt > 1:
            table.blocks[write] = self.pool.copy_on_write(shared, self.pending_copies)
        self._pass(table, start)
        self._write(table)

    def _pass(self, table: WindowTable, start: int) -> bool:
        """Give back the blocks behind the window of position `start`, oldest first; whether any
        went (the table's row is then the caller's to write)."""
        first = min(self.first_needed(start), len(table.blocks))
        if first <= table.first_held:
            return False
        for i in range(table.first_held, first):
            block = table.blocks[i]
            if block is not None:
                self.pool.release(block)
                table.blocks[i] = None
        table.first_held = first
        return True

    def _write(self, table: WindowTable) -> None:
        self.block_tables.write(table.row, table.block_ids(self.null))

    def covers(self, seq_id: int, num_tokens: int) -> bool:
        """Whether the sequence still holds the window a fork of its first `num_tokens` tokens
        reads next (its query at position `num_tokens`)."""
        table = self.tables.get(seq_id)
        return table is not None and table.first_held <= self.first_needed(num_tokens)

    def fork(self, parent_id: int, child_id: int, num_tokens: int) -> None:
        parent = self.tables[parent_id]
        blocks = parent.blocks[: -(-num_tokens // self.block_size)]
        for block in blocks:
            if block is not None:
                self.pool.touch(block)
        child = WindowTable(list(blocks), parent.first_held, self.block_tables.acquire())
        self.tables[child_id] = child
        self._write(child)

    def truncate(self, seq_id: int, num_tokens: int) -> None:
        table = self.tables.get(seq_id)
        keep = -(-num_tokens // self.block_size)
        if table is None or len(table.blocks) <= keep:
            return
        for block in reversed(table.blocks[keep:]):
            if block is not None:
                self.pool.release(block)
        table.blocks = table.blocks[:keep]
        self._write(table)

    def free(self, seq_id: int) -> None:
        table = self.tables.pop(seq_id, None)
        if table is None:
            return
        for block in reversed(table.blocks):
            if block is not None:
                self.pool.release(block)
        self.block_tables.release(table.row)

    def take_pending_copies(self) -> list[tuple[int, int]]:
        copies, self.pending_copies = self.pending_copies, []
        return copies


def _shared(block: Block | None) -> bool:
    return block is not None and block.ref_cnt > 1
