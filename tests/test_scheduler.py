"""Scheduler and KV-cache manager with fake sampler outputs: no model involved."""

from __future__ import annotations

import itertools

import pytest

from weft.config import CacheConfig, SchedulerConfig
from weft.engine.default_model import bundled_model_path
from weft.engine.kv_cache import KVCacheManager
from weft.engine.layout import SampledRows, SchedulerOutput, StepLayout
from weft.engine.scheduler import Scheduler
from weft.engine.sequence import FinishReason, Sequence, SequenceLimits, SequenceStatus
from weft.params import SamplingParams
from weft.tokenizer import Tokenizer

_ids = itertools.count()
TOKENIZER = Tokenizer.from_dir(bundled_model_path())
LIMITS = SequenceLimits(max_model_len=512, eos_token_ids=frozenset({0}))


def make_seq(num_prompt: int, max_tokens: int = 4, first_token: int = 100, **kw) -> Sequence:
    prompt = list(range(first_token, first_token + num_prompt))
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, **kw)
    return Sequence.create(next(_ids), params, prompt, LIMITS, seed=1, tokenizer=TOKENIZER)


def make_scheduler(
    num_blocks: int = 64, block_size: int = 4, budget: int = 64, max_seqs: int = 8, caching: bool = True
) -> Scheduler:
    kv = KVCacheManager(
        CacheConfig(block_size=block_size, num_blocks=num_blocks, enable_prefix_caching=caching)
    )
    return Scheduler(
        SchedulerConfig(max_num_seqs=max_seqs, max_num_batched_tokens=budget, max_model_len=512), kv
    )


def step(sched: Scheduler, token: int = 7) -> SchedulerOutput:
    """One engine step with a fake sampler that always returns `token`."""
    out = sched.schedule()
    num_rows = len(out.sampling)
    sched.advance(out)
    sched.accept(StepLayout.of(out), SampledRows([token] * num_rows, [None] * num_rows, {}))
    return out


def run_to_end(sched: Scheduler, max_steps: int = 200) -> int:
    for num_steps in range(1, max_steps + 1):
        step(sched)
        if sched.num_unfinished == 0:
            return num_steps
    raise AssertionError("requests did not finish")


@pytest.fixture
def sched():
    s = make_scheduler()
    yield s
    assert s.kv.num_used_blocks == 0, "KV blocks leaked"


def test_admission_respects_token_budget():
    s = make_scheduler(budget=16)
    a, b, c = make_seq(10), make_seq(10), make_seq(10)
    for r in (a, b, c):
        s.add(r)
    out = s.schedule()
    assert [(x.seq, x.num_new_tokens) for x in out.scheduled] == [(a, 10), (b, 6)]
    assert out.num_batched_tokens == 16
    assert [x.samples for x in out.scheduled] == [True, False]
    assert list(s.waiting) == [c]


def test_chunked_prefill_samples_only_after_the_last_chunk(sched):
    sched.config = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=16, max_model_len=512)
    r = make_seq(40, max_tokens=2)
    sched.add(r)
    chunks = []
    for _ in range(3):
        out = step(sched)
        chunks.append((out.scheduled[0].num_new_tokens, out.scheduled[0].samples))
    assert chunks == [(16, False), (16, False), (8, True)]
    assert r.num_computed_tokens == 40 and r.output_token_ids == [7]
    run_to_end(sched)
    assert r.finish_reason == FinishReason.LENGTH and r.num_output_tokens == 2


def test_decode_and_prefill_share_a_step(sched):
    first = make_seq(8, max_tokens=10)
    sched.add(first)
    step(sched)
    second = make_seq(12, first_token=300)
    sched.add(second)
    out = step(sched)
    assert [(x.seq, x.num_new_tokens) for x in out.scheduled] == [(first, 1), (second, 12)]
    run_to_end(sched)


def test_max_num_seqs_caps_running():
    s = make_scheduler(max_seqs=2)
    for _ in range(3):
        s.add(make_seq(4))
    out = s.schedule()
    assert len(out.scheduled) == 2 and len(s.waiting) == 1


def test_preemption_and_resumption_finish_everything():
    # 6 blocks of 4 tokens: two requests of 8 prompt + 12 output tokens cannot both fit.
    s = make_scheduler(num_blocks=6, budget=64)
    old, new = make_seq(8, max_tokens=12), make_seq(8, max_tokens=12, first_token=300)
    s.add(old)
    s.add(new)
    preempted = set()
    while s.num_unfinished:
        step(s)
        preempted |= {seq.seq_id for seq in (old, new) if seq.status == SequenceStatus.PREEMPTED}
    assert s.num_preemptions >= 1
    assert preempted == {new.seq_id}  # the newest is preempted first, the oldest never
    for r in (old, new):
        assert r.finish_reason == FinishReason.LENGTH and r.output_token_ids == [7] * 12
    assert s.kv.num_used_blocks == 0


def test_preempted_request_recomputes_from_zero():
    s = make_scheduler(num_blocks=4, budget=64)
    old, new = make_seq(6, max_tokens=8), make_seq(6, max_tokens=8, first_token=300)
    s.add(old)
    s.add(new)
    while new.status != SequenceStatus.PREEMPTED:
        step(s)
    assert new.num_computed_tokens == 0 and new in s.waiting
    assert s.kv.block_ids(new.seq_id) == []
    run_to_end(s)
    assert s.kv.num_used_blocks == 0


def test_abort_frees_blocks_at_once(sched):
    r = make_seq(10, max_tokens=50)
    sched.add(r)
    step(sched)
    assert sched.kv.num_used_blocks == 3
    sched.finish(r, FinishReason.ABORT)
    assert r.finish_reason == FinishReason.ABORT
    assert sched.kv.num_used_blocks == 0 and sched.num_unfinished == 0


def test_abort_of_waiting_request(sched):
    r = make_seq(10)
    sched.add(r)
    sched.finish(r, FinishReason.ABORT)
    assert sched.num_unfinished == 0 and r.is_finished


def test_prefix_cache_hit_skips_computed_blocks(sched):
    first = make_seq(14, max_tokens=1)
    sched.add(first)
    run_to_end(sched)
    second = make_seq(14, max_tokens=1)  # the same prompt tokens
    sched.add(second)
    out = step(sched)
    # 14 tokens = 3 full blocks of 4 + 2; every full block is a hit, the last 2 tokens are computed.
    assert second.num_cached_prompt_tokens == 12
    assert out.scheduled[0].num_new_tokens == 2
    assert sched.kv.num_hit_tokens == 12
    run_to_end(sched)


def test_prefix_cache_leaves_last_token_to_compute(sched):
    first = make_seq(8, max_tokens=1)
    sched.add(first)
    run_to_end(sched)
    again = make_seq(8, max_tokens=1)
    sched.add(again)
    out = step(sched)
    assert again.num_cached_prompt_tokens == 4 and out.scheduled[0].num_new_tokens == 4
    run_to_end(sched)


def test_identical_running_prefix_is_shared():
    s = make_scheduler(num_blocks=64)
    a = make_seq(16, max_tokens=20)
    s.add(a)
    step(s)
    b = make_seq(16, max_tokens=20)
    s.add(b)
    step(s)
    shared = set(s.kv.block_ids(a.seq_id)[:3]) & set(s.kv.block_ids(b.seq_id)[:3])
    assert len(shared) == 3  # the first 12 tokens' blocks are stored once
    run_to_end(s)
    assert s.kv.num_used_blocks == 0


def test_lru_eviction_reuses_oldest_freed_blocks_first():
    s = make_scheduler(num_blocks=8)
    old = make_seq(9, max_tokens=1, first_token=100)
    s.add(old)
    run_to_end(s)
    recent = make_seq(9, max_tokens=1, first_token=200)
    s.add(recent)
    run_to_end(s)
    # 8 blocks, 3 each used by two finished requests; a 17-token request needs 5 blocks, so it
    # evicts the 2 never-used blocks and then the oldest cached ones, keeping `recent`'s prefix.
    big = make_seq(17, max_tokens=1, first_token=300)
    s.add(big)
    run_to_end(s)
    probe = make_seq(9, max_tokens=1, first_token=200)
    s.add(probe)
    step(s)
    assert probe.num_cached_prompt_tokens == 8
    run_to_end(s)


def test_a_freed_block_that_caches_nothing_is_reused_first():
    """A finished request's partial last block (no hash) goes to the front of the free queue: the
    next request writes into it (pages already in memory), and the cached full blocks wait at the
    back. With prefix caching off, every freed block is reused before a never-used one."""
    s = make_scheduler(num_blocks=8)
    first = make_seq(9, max_tokens=2, first_token=100)  # blocks of 4: two full ones and a partial one
    s.add(first)
    step(s)
    partial = s.kv.block_ids(first.seq_id)[2]
    run_to_end(s)
    later = make_seq(3, max_tokens=2, first_token=500)  # one block: the partial one, not a fresh one
    s.add(later)
    step(s)
    assert s.kv.block_ids(later.seq_id) == [partial]
    run_to_end(s)
    probe = make_seq(9, max_tokens=1, first_token=100)  # the first request's full blocks are cached still
    s.add(probe)
    step(s)
    assert probe.num_cached_prompt_tokens == 8
    run_to_end(s)
    uncached = make_scheduler(num_blocks=8, caching=False)
    a = make_seq(9, max_tokens=2, first_token=100)
    uncached.add(a)
    step(uncached)
    used = set(uncached.kv.block_ids(a.seq_id))
    run_to_end(uncached)
    b = make_seq(9, max_tokens=2, first_token=300)
    uncached.add(b)
    step(uncached)
    assert set(uncached.kv.block_ids(b.seq_id)) == used
    run_to_end(uncached)


def test_fork_shares_blocks_and_copies_on_write():
    s = make_scheduler(num_blocks=16)
    parent = make_seq(6, max_tokens=5)
    child = parent.fork(next(_ids), index=1, seed=2)  # forked before the parent sampled anything
    s.add(parent)
    step(s)  # computes 6 prompt tokens (blocks: one full, one with 2 of 4 slots), samples one
    s.add_forked([(parent, child)])
    out = step(s)  # the parent decodes; the child joins, sharing the parent's blocks
    assert child.num_computed_tokens == 6 and child.num_output_tokens == 1
    parent_blocks, child_blocks = s.kv.block_ids(parent.seq_id), s.kv.block_ids(child.seq_id)
    assert parent_blocks[0] == child_blocks[0]  # the full block stays shared
    assert parent_blocks[1] != child_blocks[1]  # whoever wrote first into the shared block copied it
    assert len(out.block_copies) == 1 and set(out.block_copies[0]) == {parent_blocks[1], child_blocks[1]}
    run_to_end(s)
    assert child.num_output_tokens == 5 and parent.num_output_tokens == 5
    assert s.kv.num_used_blocks == 0


def test_fork_waits_for_room_under_max_num_seqs():
    s = make_scheduler(num_blocks=32, max_seqs=2)
    parent = make_seq(6, max_tokens=3)
    children = [parent.fork(next(_ids), index=i, seed=i) for i in (1, 2)]
    s.add(parent)
    step(s)
    s.add_forked([(parent, child) for child in children])
    out = step(s)
    assert len(s.running) == 2 and len(out.scheduled) == 2  # one fork admitted, one waiting
    run_to_end(s)
    assert all(c.num_output_tokens == 3 for c in children)
    assert s.kv.num_used_blocks == 0
