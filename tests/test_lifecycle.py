"""The life cycle of sequences against the KV manager, randomized: add, fork, prune, step (with
preemption under a small pool), abort and finish in any order keep reference counts, the free
queue and the prefix-cache hashes consistent, and never lose or double-free a block."""

from __future__ import annotations

import itertools
from collections import Counter

import numpy as np
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from weft.config import CacheConfig, SchedulerConfig, SpeculativeConfig
from weft.engine.default_model import bundled_model_path
from weft.engine.kv_cache import KVCacheManager
from weft.engine.layout import Draft, SampledRows, StepLayout
from weft.engine.scheduler import Scheduler
from weft.engine.sequence import FinishReason, Sequence, SequenceLimits
from weft.engine.speculation import Speculation
from weft.params import SamplingParams
from weft.tokenizer import Tokenizer

TOKENIZER = Tokenizer.from_dir(bundled_model_path())
BLOCK_SIZE = 4
MAX_LEN = 40
LIMITS = SequenceLimits(max_model_len=MAX_LEN, eos_token_ids=frozenset({0}))
VERIFY = Speculation(SpeculativeConfig(num_speculative_tokens=4)).verify  # drafts checked as the engine does

OPS = st.one_of(
    st.tuples(st.just("add"), st.integers(1, 14), st.integers(5, 7), st.integers(1, 24)),
    st.tuples(st.just("fork"), st.integers(0, 50)),
    st.tuples(st.just("prune"), st.integers(0, 50)),
    st.tuples(st.just("abort"), st.integers(0, 50)),
    st.tuples(st.just("step"), st.integers(5, 8)),
    st.tuples(st.just("step"), st.integers(5, 8)),
    st.tuples(st.just("speculate"), st.integers(5, 8), st.integers(1, 5), st.integers(0, 5)),
)


class World:
    def __init__(self, num_blocks: int, max_seqs: int, budget: int) -> None:
        cache = CacheConfig(block_size=BLOCK_SIZE, num_blocks=num_blocks, enable_prefix_caching=True)
        self.kv = KVCacheManager(cache)
        self.sched = Scheduler(SchedulerConfig(max_seqs, budget, MAX_LEN), self.kv)
        self.ids = itertools.count()
        self.live: list[Sequence] = []

    def add(self, num_prompt: int, token: int, max_tokens: int) -> None:
        prompt = [token] * (num_prompt // 2) + list(range(5, 5 + num_prompt - num_prompt // 2))
        params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
        seq = Sequence.create(next(self.ids), params, prompt, LIMITS, seed=1, tokenizer=TOKENIZER)
        self.sched.add(seq)
        self.live.append(seq)

    def pick(self, idx: int) -> Sequence | None:
        alive = [s for s in self.live if not s.is_finished]
        return alive[idx % len(alive)] if alive else None

    def fork(self, idx: int) -> None:
        parent = self.pick(idx)
        if parent is not None:
            child = parent.fork(next(self.ids), index=1, seed=2)
            self.sched.add_forked([(parent, child)])
            self.live.append(child)

    def finish(self, idx: int, reason: FinishReason) -> None:
        seq = self.pick(idx)
        if seq is not None:
            self.sched.finish(seq, reason)

    def step(self, token: int) -> None:
        out = self.sched.schedule()
        rows = len(out.sampling)
        self.sched.advance(out)
        self.sched.accept(StepLayout.of(out), SampledRows([token] * rows, [None] * rows, {}))

    def speculate(self, token: int, num_drafts: int, num_right: int) -> None:
        """A step in which every running sequence guesses `num_drafts` tokens, of which the first
        `num_right` are what its rows sample (then `token`): accepted drafts, rolled-back ones."""
        drafts = {
            s.seq_id: Draft([5 + (s.seq_id + i) % 3 for i in range(num_drafts)]) for s in self.sched.running
        }
        out = self.sched.schedule(drafts)
        tokens = []
        for item in out.scheduled:
            if item.samples:
                guessed = item.drafts
                tokens += [
                    guessed[i] if i < min(num_right, len(guessed)) else token for i in range(len(guessed) + 1)
                ]
        assert len(tokens) == sum(item.num_rows for item in out.scheduled)
        self.sched.advance(out)
        self.sched.accept(StepLayout.of(out), SampledRows(tokens, [None] * len(tokens), {}), VERIFY)


def check_invariants(world: World) -> None:
    check_kv_cache(world.kv, world.sched)
    for seq in world.live:
        assert seq.num_computed_tokens <= seq.num_tokens
        assert not (seq.is_finished and (seq in world.sched.running or seq in world.sched.waiting))


def check_kv_cache(kv: KVCacheManager, sched: Scheduler) -> None:
    """Reference counts, the free queue, the prefix-cache hashes and the block tables agree with
    the sequences the scheduler holds."""
    pool, block_size = kv.pool, kv.block_size
    refs = Counter(b.block_id for table in kv.tables.values() for b in table.blocks)
    for block in pool.blocks:
        assert block.ref_cnt == refs[block.block_id], f"block {block.block_id}: ref count drifted"
        assert (block.block_id in pool.free_queue) == (block.ref_cnt == 0), "free queue out of sync"
    for block_hash, block in pool.cached.items():
        assert block.block_hash == block_hash and len(block.token_ids) == block_size
    # Running sequences hold blocks, and so do queued forks sharing their parent's (with a
    # computed prefix); nothing else.
    holders = list(sched.running) + [s for s in sched.waiting if s.num_computed_tokens > 0]
    assert set(kv.tables) == {s.seq_id for s in holders}, "only running sequences and forks hold blocks"
    check_block_table_rows(kv)
    for seq in holders:
        table = kv.tables[seq.seq_id]
        assert table.block_ids == [b.block_id for b in table.blocks], "cached block ids drifted"
        assert len(table.blocks) * block_size >= seq.num_computed_tokens
        assert len(table.blocks) <= -(-seq.num_tokens // block_size), "blocks past its tokens (drafts'?)"
        parent = None
        for i, block_hash in enumerate(table.hashes):
            tokens = tuple(seq.token_ids[i * block_size : (i + 1) * block_size])
            parent = hash((parent, tokens))
            assert block_hash == parent, "a sequence's hash chain does not match its tokens"
        assert len(table.hashes) * block_size <= seq.num_computed_tokens


def check_block_table_rows(kv: KVCacheManager) -> None:
    """The persistent block-table array equals the tables rebuilt from scratch: each sequence's
    row holds exactly its block ids, padded with 0, no two sequences share a row, and every other
    row is all zeros."""
    array = kv.block_tables.array
    rows = [t.row for t in kv.tables.values()]
    assert len(set(rows)) == len(rows), "two sequences share a block-table row"
    expected = np.zeros_like(array)
    for table in kv.tables.values():
        expected[table.row, : len(table.block_ids)] = table.block_ids
    assert np.array_equal(array, expected), "the persistent block tables drifted from the sequences'"
    if kv.tables:
        gathered = kv.block_tables.gather(rows)
        width = max(len(t.block_ids) for t in kv.tables.values())
        assert gathered.shape == (len(rows), width)
        assert np.array_equal(gathered, expected[rows, :width])


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    first=st.lists(
        st.tuples(st.integers(1, 14), st.integers(5, 7), st.integers(1, 24)), min_size=1, max_size=6
    ),
    ops=st.lists(OPS, min_size=1, max_size=40),
    num_blocks=st.integers(11, 18),
    max_seqs=st.integers(2, 6),
    budget=st.integers(4, 32),
)
@example(  # queued forks held the blocks the preempted head needed, and nothing ran to free them
    first=[(1, 5, 3), (7, 5, 15), (11, 5, 6), (3, 5, 3)],
    ops=[("step", 5), ("step", 5), ("fork", 0), ("step", 5), ("fork", 0), ("fork", 1)],
    num_blocks=11,
    max_seqs=4,
    budget=19,
)
def test_random_life_cycles_keep_the_kv_cache_consistent(first, ops, num_blocks, max_seqs, budget):
    world = World(num_blocks, max_seqs, budget)
    for num_prompt, token, max_tokens in first:
        world.add(num_prompt, token, max_tokens)
    for op in ops:
        if op[0] == "add":
            world.add(op[1], op[2], op[3])
        elif op[0] == "fork":
            world.fork(op[1])
        elif op[0] == "prune":
            world.finish(op[1], FinishReason.PRUNED)
        elif op[0] == "abort":
            world.finish(op[1], FinishReason.ABORT)
        elif op[0] == "speculate":
            world.speculate(op[1], op[2], op[3])
        else:
            world.step(op[1])
        check_invariants(world)
    for _ in range(400):  # every sequence finishes (max_tokens), none is lost on the way
        if world.sched.num_unfinished == 0:
            break
        world.step(9)
        check_invariants(world)
    assert world.sched.num_unfinished == 0
    assert all(s.is_finished for s in world.live), "a sequence was lost"
    assert world.kv.num_used_blocks == 0 and not world.kv.tables
