"""Paged KV-cache bookkeeping: which block holds which tokens of which request.

The KV tensors themselves live in the model runner; this module only hands out block ids.

- Blocks have reference counts. A block with no references sits in the free queue, oldest first,
  and is reused from the front (LRU).
- A *full* block is identified by the hash chain of its tokens (`hash((parent_hash, tokens))`),
  so identical prefixes are stored once: across requests (prefix caching), across the samples of
  one prompt and across beams. A freed block keeps its hash until it is reused, so a later request
  with the same prefix can revive it.
- Forking a sequence shares the blocks of the prefix it copied. Before a sequence writes into a
  block that others also reference, it gets a private copy (copy-on-write), recorded as a
  (src, dst) pair for the runner to copy before the forward pass.
- Sequences are known by their integer `seq_id`; the manager keeps one `SeqBlocks` per sequence,
  whose block ids are also one row of a persistent host array (`block_tables`) that a step's model
  inputs take their tables from, written only when the table changes.
- A model with sliding-window layers keeps those layers' blocks in a second pool, where a sequence
  holds only its window (`weft/engine/window_blocks.py`); every method here drives both pools, and
  an allocation happens in both or in neither.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from weft.config import CacheConfig
from weft.engine.block_table import BlockTableArray
from weft.engine.kv_blocks import Block, BlockPool
from weft.engine.sequence import Sequence
from weft.engine.window_blocks import WindowBlocks


@dataclass(frozen=True, slots=True)
class ComputedBlocks:
    """Prefix-cache hits for a new sequence: its first `len(blocks)` blocks are already computed."""

    blocks: list[Block]
    hashes: list[int]  # the hash chain of those blocks
    window_blocks: list[Block] = field(default_factory=list)  # the window pool's, for the window before them

    def num_tokens(self, block_size: int) -> int:
        return len(self.blocks) * block_size


@dataclass(slots=True)
class SeqBlocks:
    """The block table of one sequence, and the hash chain of its leading full, computed blocks."""

    blocks: list[Block] = field(default_factory=list)
    hashes: list[int] = field(default_factory=list)
    block_ids: list[int] = field(default_factory=list)  # the ids of `blocks`, kept in step with them
    row: int = -1  # its row of `KVCacheManager.block_tables`, which holds `block_ids` too
    window_row: int = -1  # its row of the window pool's tables (`WindowBlocks.block_tables`)


@dataclass(frozen=True, slots=True)
class Borrowed:
    """Blocks lent for tokens computed outside any sequence (a scoring pass), in each pool."""

    blocks: list[Block]
    window_blocks: list[Block]

    @property
    def block_ids(self) -> list[int]:
        return [b.block_id for b in self.blocks]

    @property
    def window_block_ids(self) -> list[int] | None:
        return [b.block_id for b in self.window_blocks] if self.window_blocks else None


class KVCacheManager:
    """The scheduler's narrow interface to KV memory."""

    def __init__(self, config: CacheConfig) -> None:
        self.block_size = config.block_size
        self.enable_caching = config.enable_prefix_caching
        self.pool = BlockPool(config.num_blocks)
        self.tables: dict[int, SeqBlocks] = {}  # seq_id -> its blocks
        self.block_tables = BlockTableArray()  # every table in `tables`, one row each, for the runner
        self.pending_copies: list[tuple[int, int]] = []  # (src, dst) block ids, copy-on-write
        self.num_hit_tokens = 0
        self.num_queried_tokens = 0
        # the sliding-window layers' own blocks (`CacheConfig.num_window_blocks`); None: they share these
        self.window = (
            WindowBlocks(config.num_window_blocks, config.block_size, config.window)
            if config.num_window_blocks
            else None
        )

    @property
    def num_blocks(self) -> int:
        """Blocks of both pools."""
        return len(self.pool.blocks) + (self.window.num_blocks if self.window else 0)

    @property
    def num_used_blocks(self) -> int:
        """Blocks in use in both pools."""
        return sum(self.used_blocks_per_pool)

    @property
    def used_blocks_per_pool(self) -> tuple[int, int]:
        """(the main pool's blocks in use, the window pool's)."""
        return len(self.pool.blocks) - self.pool.num_free, self.window.num_used_blocks if self.window else 0

    def can_share(self, seq_id: int, num_tokens: int) -> bool:
        """Whether a fork of the sequence's first `num_tokens` tokens can share its blocks (it holds
        them, and the window before position `num_tokens`)."""
        return seq_id in self.tables and (self.window is None or self.window.covers(seq_id, num_tokens))

    def holds(self, seq_id: int) -> bool:
        """Whether the sequence has blocks."""
        return seq_id in self.tables

    def block_ids(self, seq_id: int) -> list[int]:
        table = self.tables.get(seq_id)
        return [] if table is None else list(table.block_ids)

    def get_computed_blocks(self, seq: Sequence) -> ComputedBlocks:
        """Longest cached prefix of `seq`, in full blocks, leaving every position whose hidden
        state the sequence needs to compute (at least the last token's, for its logits; see
        `Sequence.first_position_needed`)."""
        if not self.enable_caching:
            return ComputedBlocks([], [])
        max_blocks = seq.first_position_needed // self.block_size
        hits: list[Block] = []
        hashes: list[int] = []
        parent: int | None = None
        for i in range(max_blocks):
            tokens = tuple(seq.token_ids[i * self.block_size : (i + 1) * self.block_size])
            parent = hash((parent, tokens))
            block = self.pool.lookup(parent, tokens)
            if block is None:
                break
            hits.append(block)
            hashes.append(parent)
        if self.window is None or not hits:
            return ComputedBlocks(hits, hashes)
        num_hits, window_blocks = self.window.hits(hashes, [b.token_ids for b in hits])
        return ComputedBlocks(hits[:num_hits], hashes[:num_hits], window_blocks)

    def record_prefix_query(self, num_tokens: int, num_hit_tokens: int) -> None:
        self.num_queried_tokens += num_tokens
        self.num_hit_tokens += num_hit_tokens

    def allocate_slots(
        self, seq: Sequence, num_new_tokens: int, computed: ComputedBlocks | None = None
    ) -> SeqBlocks | None:
        """Make room for `num_new_tokens` more tokens of `seq` (after any prefix-cache hits in
        `computed`). Returns the sequence's block table, or None (changing nothing) if there are
        not enough free blocks."""
        table = self.tables.get(seq.seq_id)
        window = self.window
        if table is not None and not (computed and computed.blocks):  # most often: its blocks have room
            start = seq.num_computed_tokens
            blocks, write_idx = table.blocks, start // self.block_size
            fits = start + num_new_tokens <= len(blocks) * self.block_size
            if (
                fits
                and (write_idx >= len(blocks) or blocks[write_idx].ref_cnt == 1)
                and (window is None or window.ready(seq.seq_id, start, start + num_new_tokens))
            ):
                return table  # no new block, no copy-on-write
        table = table or SeqBlocks()
        blocks = table.blocks
        hits = computed.blocks if computed else []
        num_computed = seq.num_computed_tokens + len(hits) * self.block_size
        num_needed = -(-(num_computed + num_new_tokens) // self.block_size)
        num_new_blocks = max(0, num_needed - len(blocks) - len(hits))
        write_idx = num_computed // self.block_size
        needs_copy = write_idx < len(blocks) and blocks[write_idx].ref_cnt > 1
        num_revived = sum(1 for b in hits if b.ref_cnt == 0)
        if num_new_blocks + int(needs_copy) + num_revived > self.pool.num_free:
            return None
        window_hits = computed.window_blocks if computed else []
        end = num_computed + num_new_tokens
        if (
            window is not None
            and window.needed(seq.seq_id, num_computed, end, window_hits) > window.pool.num_free
        ):
            return None  # (the window pool: both pools' blocks, or neither's)
        for block in hits:
            self.pool.touch(block)
        blocks = blocks + hits + [self.pool.allocate() for _ in range(num_new_blocks)]
        if needs_copy:
            blocks[write_idx] = self.pool.copy_on_write(blocks[write_idx], self.pending_copies)
        table.blocks = blocks
        table.block_ids = [b.block_id for b in blocks]
        if computed is not None:
            table.hashes = table.hashes + computed.hashes
        if table.row < 0:
            table.row = self.block_tables.acquire()
        self.block_tables.write(table.row, table.block_ids)
        self.tables[seq.seq_id] = table
        if window is not None:
            window.grow(seq.seq_id, num_computed, end, window_hits)
            table.window_row = window.row(seq.seq_id)
        return table

    def cache_full_blocks(self, seq: Sequence) -> None:
        """Register every block that is now full of computed tokens under its hash chain."""
        table = self.tables.get(seq.seq_id)
        if not self.enable_caching or table is None:
            return
        num_full = min(seq.num_computed_tokens // self.block_size, len(table.blocks))
        parent = table.hashes[-1] if table.hashes else None
        for i in range(len(table.hashes), num_full):
            tokens = tuple(seq.token_ids[i * self.block_size : (i + 1) * self.block_size])
            parent = hash((parent, tokens))
            self.pool.register(table.blocks[i], parent, tokens)
            table.hashes.append(parent)
            if self.window is not None:
                self.window.register(seq.seq_id, i, parent, tokens)

    def fork(self, parent_id: int, child_id: int, num_tokens: int) -> None:
        """Give the child the parent's blocks that hold its first `num_tokens` tokens, shared; the
        first write into a shared block copies it (copy-on-write)."""
        parent = self.tables[parent_id]
        num_blocks = -(-num_tokens // self.block_size)
        blocks = parent.blocks[:num_blocks]
        for block in blocks:
            self.pool.touch(block)
        hashes = parent.hashes[: num_tokens // self.block_size]
        child = SeqBlocks(list(blocks), hashes, [b.block_id for b in blocks], self.block_tables.acquire())
        self.block_tables.write(child.row, child.block_ids)
        self.tables[child_id] = child
        if self.window is not None:
            assert self.window.covers(parent_id, num_tokens), "a fork whose window its parent gave back"
            self.window.fork(parent_id, child_id, num_tokens)
            child.window_row = self.window.row(child_id)

    def free(self, seq_id: int) -> None:
        """Release the sequence's blocks, tail first, so that the tail is evicted first."""
        table = self.tables.pop(seq_id, None)
        if table is None:
            return
        for block in reversed(table.blocks):
            self.pool.release(block)
        self.block_tables.release(table.row)
        if self.window is not None:
            self.window.free(seq_id)

    def truncate(self, seq_id: int, num_tokens: int) -> None:
        """Give back the sequence's blocks past those of its first `num_tokens` tokens, tail first
        (the slots of rejected drafts; never a cached block: only computed tokens are hashed)."""
        table = self.tables.get(seq_id)
        keep = -(-num_tokens // self.block_size)
        if self.window is not None:
            self.window.truncate(seq_id, num_tokens)
        if table is None or len(table.blocks) <= keep:
            return
        for block in reversed(table.blocks[keep:]):
            self.pool.release(block)
        table.blocks, table.block_ids = table.blocks[:keep], table.block_ids[:keep]
        self.block_tables.write(table.row, table.block_ids)

    def borrow(self, num_tokens: int) -> Borrowed | None:
        """Private blocks for `num_tokens` tokens computed outside any sequence (a scoring pass), in
        each pool; None when there are not enough free blocks. Return them with `give_back`."""
        num_blocks = -(-num_tokens // self.block_size)
        window = self.window
        if num_blocks > self.pool.num_free or (window is not None and num_blocks > window.pool.num_free):
            return None
        blocks = [self.pool.allocate() for _ in range(num_blocks)]
        return Borrowed(blocks, [window.pool.allocate() for _ in range(num_blocks)] if window else [])

    def give_back(self, borrowed: Borrowed) -> None:
        for block in reversed(borrowed.blocks):
            self.pool.release(block)
        for block in reversed(borrowed.window_blocks):
            assert self.window is not None
            self.window.pool.release(block)

    def take_pending_copies(self) -> list[tuple[int, int]]:
        copies, self.pending_copies = self.pending_copies, []
        return copies

    def take_window_copies(self) -> list[tuple[int, int]]:
        """Copy-on-write in the window pool: (src, dst) block ids there."""
        return self.window.take_pending_copies() if self.window is not None else []
