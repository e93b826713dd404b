"""weft's CPU kernels against the plain torch code they replace (which the parity tests compare with
transformers), and the fallback switch."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

import weft.native as native
from weft import ops
from weft.config import RopeConfig
from weft.engine.loading import kernels_for
from weft.kernels import NATIVE_CPU_KERNELS, TORCH_KERNELS
from weft.model.attention import PagedAttention
from weft.model.layers import Linear, RotaryEmbedding, WeightLayout, weight_layout

NATIVE, TORCH = PagedAttention(NATIVE_CPU_KERNELS), PagedAttention(TORCH_KERNELS)


@pytest.fixture(scope="module", autouse=True)
def kernels():
    if not native.kernels_available():
        if os.environ.get("CI"):
            pytest.fail("the CPU kernels must build in CI (g++ and ninja are expected there)")
        pytest.skip(
            "weft's CPU kernels are off (WEFT_NATIVE=0) or could not be built here (no C++ compiler?)"
        )


TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2e-2}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_matches_torch(dtype):
    weight = torch.randn(96).to(dtype)
    x = torch.randn(7, 2 * 96).to(dtype)[:, 5:101]  # strided rows
    native_out = NATIVE_CPU_KERNELS.rms_norm(x, weight, 1e-6)
    expected = TORCH_KERNELS.rms_norm(x, weight, 1e-6)
    torch.testing.assert_close(native_out, expected, rtol=TOLERANCE[dtype], atol=TOLERANCE[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_add_rms_norm_matches_torch(dtype):
    weight = torch.randn(96).to(dtype)
    x, delta = torch.randn(37, 96).to(dtype), torch.randn(37, 96).to(dtype)
    native_x, torch_x = x.clone(), x.clone()
    native_out = NATIVE_CPU_KERNELS.add_rms_norm_(native_x, delta, weight, 1e-6)
    expected = TORCH_KERNELS.add_rms_norm_(torch_x, delta, weight, 1e-6)
    assert torch.equal(native_x, torch_x)  # the residual stream, updated in place
    torch.testing.assert_close(native_out, expected, rtol=TOLERANCE[dtype], atol=TOLERANCE[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rope_matches_torch(dtype):
    positions = torch.tensor([0, 1, 5, 200, 511, 3])
    qkv = torch.randn(6, 9, 64).to(dtype)  # q: 4 heads, k: 2 heads, v: 3 heads, untouched
    outputs = []
    for kernels in (NATIVE_CPU_KERNELS, TORCH_KERNELS):
        rotary = RotaryEmbedding(64, 512, RopeConfig(theta=10000.0), kernels=kernels)
        out = qkv.clone()
        kernels.apply_rope_(out[:, :6], rotary.tables(positions, dtype))
        outputs.append(out)
    native_out, expected = outputs
    torch.testing.assert_close(native_out, expected, rtol=TOLERANCE[dtype], atol=TOLERANCE[dtype])
    assert torch.equal(native_out[:, 6:], qkv[:, 6:])


def _scattered_block_tables(context_lens, block_size, gen):
    """Block tables over a pool with spare blocks, handed out in a random order; and the pool size."""
    num_blocks = sum(-(-n // block_size) for n in context_lens) + 3
    order = torch.randperm(num_blocks, generator=gen).tolist()
    tables, used = [], 0
    for n in context_lens:
        count = -(-n // block_size)
        tables.append(order[used : used + count])
        used += count
    return tables, num_blocks


def _random_paged_batch(context_lens, num_heads, num_kv_heads, dtype, block_size=4, head_dim=16):
    gen = torch.Generator().manual_seed(sum(context_lens))
    tables, num_blocks = _scattered_block_tables(context_lens, block_size, gen)
    kv_cache = torch.randn(num_blocks, block_size, 2, num_kv_heads, head_dim, generator=gen).to(dtype)
    q = torch.randn(len(context_lens), num_heads, head_dim, generator=gen).to(dtype)
    kv_new = torch.randn(len(context_lens), 2, num_kv_heads, head_dim, generator=gen).to(dtype)
    meta, _ = NATIVE.build_metadata([1] * len(context_lens), context_lens, tables, block_size, q.device)
    return q, kv_new, kv_cache, meta


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads", [(4, 4), (8, 2), (6, 1)])
def test_decode_attention_matches_gather_and_sdpa(dtype, heads):
    q, kv_new, kv_cache, meta = _random_paged_batch([1, 4, 5, 17, 33], *heads, dtype)
    native_cache, torch_cache = kv_cache.clone(), kv_cache.clone()
    native_out = NATIVE(q, kv_new, native_cache, meta, 0.25)
    expected = TORCH(q, kv_new, torch_cache, meta, 0.25)
    torch.testing.assert_close(native_out, expected, rtol=TOLERANCE[dtype], atol=TOLERANCE[dtype])
    assert torch.equal(native_cache, torch_cache)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_dim", [32, 64, 128])
@pytest.mark.parametrize("heads", [(9, 3), (8, 2), (8, 4), (16, 2)])
def test_decode_attention_with_specialised_head_sizes(dtype, head_dim, heads):
    """Head sizes 32 (the bundled model's), 64 and 128 with full 16-token blocks take the kernel's
    unrolled (and, where the CPU has AVX-512, vectorised 16-tokens-at-once) score loop; groups of 2,
    4 and 8 query heads per KV head its tiles of 2 or 4 heads (a group of 3, one head at a time),
    with contexts that end mid-tile."""
    q, kv_new, kv_cache, meta = _random_paged_batch([1, 16, 17, 19, 42, 64], *heads, dtype, 16, head_dim)
    native_cache, torch_cache = kv_cache.clone(), kv_cache.clone()
    native_out = NATIVE(q, kv_new, native_cache, meta, head_dim**-0.5)
    expected = TORCH(q, kv_new, torch_cache, meta, head_dim**-0.5)
    torch.testing.assert_close(native_out, expected, rtol=TOLERANCE[dtype], atol=TOLERANCE[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_attention_over_several_chunks(dtype):
    """8 KV heads of 128 fill the kernel's chunk (about 256 KB of cache) every 32 tokens, so these
    contexts run one to 22 chunks, whose softmax sums are carried from chunk to chunk, and a single
    sequence is split over the threads as well."""
    for lens in ([1, 33, 100, 700], [700]):
        q, kv_new, kv_cache, meta = _random_paged_batch(lens, 16, 8, dtype, 16, 128)
        native_cache, torch_cache = kv_cache.clone(), kv_cache.clone()
        native_out = NATIVE(q, kv_new, native_cache, meta, 128**-0.5)
        expected = TORCH(q, kv_new, torch_cache, meta, 128**-0.5)
        torch.testing.assert_close(native_out, expected, rtol=TOLERANCE[dtype], atol=TOLERANCE[dtype])


def test_decode_attention_is_batch_invariant():
    """A row's attention is the same bits alone, beside rows of other lengths (which widen the
    block table), and on one thread or two: its context is cut into ranges of a fixed size, never
    by the batch or the thread count (speculative verification relies on it)."""
    gen = torch.Generator().manual_seed(21)
    lens = [700, 1, 33, 100, 2000, 700]
    tables, num_blocks = _scattered_block_tables(lens, 16, gen)
    cache = torch.randn(num_blocks, 16, 2, 2, 64, generator=gen)
    q = torch.randn(len(lens), 8, 64, generator=gen)
    padded = torch.tensor([t + [0] * (max(map(len, tables)) - len(t)) for t in tables])
    attend = torch.ops.weft.paged_decode_attention
    together = attend(q, cache, padded, torch.tensor(lens), 0.125)
    threads = torch.get_num_threads()
    try:
        for num_threads in (1, 2):
            torch.set_num_threads(num_threads)
            for i, n in enumerate(lens):
                alone = attend(q[i : i + 1], cache, torch.tensor([tables[i]]), torch.tensor([n]), 0.125)
                assert torch.equal(alone[0], together[i]), (i, num_threads)
    finally:
        torch.set_num_threads(threads)


def _mixed_step(backend: PagedAttention, dtype=torch.float32):
    """One step with decode rows, short multi-token rows (attended token by token with the kernel)
    and a long prompt chunk; the cache gets the step's keys and values written first."""
    query_lens, context_lens, block_size = [1, 3, 8, 20, 1], [9, 12, 8, 29, 40], 4
    gen = torch.Generator().manual_seed(7)
    tables, num_blocks = _scattered_block_tables(context_lens, block_size, gen)
    kv_cache = torch.randn(num_blocks, block_size, 2, 2, 16, generator=gen).to(dtype)
    q = torch.randn(sum(query_lens), 6, 16, generator=gen).to(dtype)
    kv_new = torch.randn(sum(query_lens), 2, 2, 16, generator=gen).to(dtype)
    meta, _ = backend.build_metadata(query_lens, context_lens, tables, block_size, q.device)
    return backend(q, kv_new, kv_cache, meta, 0.25), meta


def test_short_multi_token_rows_attend_token_by_token():
    native_out, native_meta = _mixed_step(NATIVE)
    torch_out, torch_meta = _mixed_step(TORCH)
    torch.testing.assert_close(native_out, torch_out, rtol=1e-5, atol=1e-5)
    # with the kernel: 1 + 3 + 8 + 1 tokens in one single-query group, the 20-token chunk apart
    assert [g.num_seqs for g in native_meta.groups] == [13, 1]
    assert [g.num_seqs for g in torch_meta.groups] == [2, 3]


def _groups_and_outputs(kv_group: int, query_lens, context_lens, heads, seed):
    """One step of `query_lens` rows after `context_lens` tokens (heads: query, KV; blocks of 16)
    through a native backend told the model's `kv_group`, one told nothing, and SDPA: each one's
    group sizes, and the two native outputs checked against SDPA's."""
    gen = torch.Generator().manual_seed(seed)
    tables, num_blocks = _scattered_block_tables(context_lens, 16, gen)
    kv_cache = torch.randn(num_blocks, 16, 2, heads[1], 32, generator=gen)
    q = torch.randn(sum(query_lens), heads[0], 32, generator=gen)
    kv_new = torch.randn(sum(query_lens), 2, heads[1], 32, generator=gen)
    outputs, groups = [], []
    told = PagedAttention(NATIVE_CPU_KERNELS, 32, kv_group, heads[0])
    untold = PagedAttention(NATIVE_CPU_KERNELS, 32)
    for backend in (told, untold, TORCH):
        meta, _ = backend.build_metadata(query_lens, context_lens, tables, 16, q.device)
        outputs.append(backend(q, kv_new, kv_cache.clone(), meta, 0.2))
        groups.append([g.num_seqs for g in meta.groups])
    torch.testing.assert_close(outputs[0], outputs[2], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(outputs[1], outputs[2], rtol=1e-5, atol=1e-5)
    return groups[:2]


def test_forced_tokens_with_drafts_attend_token_by_token_without_gqa():
    """Rows of 9-16 tokens (forced tokens with drafts after them) join the single-query group where
    every query head has a KV head of its own and the context is at most 512 tokens; past 512, or
    where the model's group is not known, they take the prefill kernel."""
    groups = _groups_and_outputs(1, [1, 12, 16, 12], [9, 100, 512, 600], (4, 4), seed=11)
    assert groups == [[1 + 12 + 16, 1], [1, 3]]


def test_short_prompts_and_long_verifying_steps_attend_token_by_token_without_gqa():
    """Without GQA, rows past 16 tokens attend token by token too while their tokens x context x
    heads x head size is within `tokenwise_work_without_gqa` (a short prompt, a verifying step
    that runs on through forced tokens): here 4 heads of 32, so up to 3,072 tokens x context."""
    assert NATIVE_CPU_KERNELS.tokenwise_work_without_gqa == 2048 * 6 * 32
    groups = _groups_and_outputs(1, [1, 20, 40, 24], [9, 20, 76, 200], (4, 4), seed=13)
    assert groups == [[1 + 20 + 40, 1], [1, 3]]


def test_with_wide_gqa_short_rows_after_long_contexts_take_the_prefill_kernel():
    """With 4 query heads per KV head, a row of 8 tokens attends token by token after 100 tokens
    of context (8 x 100 <= 2,048) and through the prefill kernel after 600; a model whose group is
    unknown keeps the rule of up to 8 tokens."""
    groups = _groups_and_outputs(4, [1, 8, 8], [9, 100, 600], (8, 2), seed=12)
    assert groups == [[1 + 8, 1], [1 + 8 + 8]]


def _prefill_step(
    backend: PagedAttention, query_lens, context_lens, heads, head_dim, block_size, scale=0.3, bfloat16=False
):
    """A step of multi-token rows (fresh prompts and chunks after a cached prefix) through `backend`,
    the step's keys and values written to the cache first; its output and the step's groups.
    `bfloat16`: q, k and v drawn as bfloat16 values (rounding them again changes nothing)."""
    gen = torch.Generator().manual_seed(sum(context_lens) + head_dim)
    tables, num_blocks = _scattered_block_tables(context_lens, block_size, gen)
    num_heads, num_kv_heads = heads
    kv_cache = torch.randn(num_blocks, block_size, 2, num_kv_heads, head_dim, generator=gen)
    q = torch.randn(sum(query_lens), num_heads, head_dim, generator=gen)
    kv_new = torch.randn(sum(query_lens), 2, num_kv_heads, head_dim, generator=gen)
    if bfloat16:
        kv_cache, q, kv_new = (t.bfloat16().float() for t in (kv_cache, q, kv_new))
    meta, _ = backend.build_metadata(query_lens, context_lens, tables, block_size, q.device)
    return backend(q, kv_new, kv_cache, meta, scale), meta.groups


PREFILL_STEPS = [  # (query_lens, context_lens): chunks of 32 queries and blocks of 32 keys cut unevenly
    ([100, 9, 33, 64], [100, 40, 80, 64]),
    ([70, 12], [250, 12]),
]


@pytest.mark.parametrize("head_dim", [16, 32, 64, 128, 256])
@pytest.mark.parametrize("heads", [(8, 2), (6, 1), (4, 4)])
@pytest.mark.parametrize("block_size", [4, 16])
def test_prefill_attention_matches_gather_and_sdpa(head_dim, heads, block_size):
    """Multi-token rows attend through the in-place kernel (no gathered blocks, no mask) and match
    SDPA over the gathered blocks with the causal mask."""
    native_backend = PagedAttention(NATIVE_CPU_KERNELS, head_dim)
    for query_lens, context_lens in PREFILL_STEPS:
        out, groups = _prefill_step(native_backend, query_lens, context_lens, heads, head_dim, block_size)
        expected, _ = _prefill_step(TORCH, query_lens, context_lens, heads, head_dim, block_size)
        assert all(g.query_start is not None for g in groups)  # the kernel did attend
        tolerance = 1e-5 * max(1, head_dim // 64)  # (float32 sums of head_dim products, in other orders)
        torch.testing.assert_close(out, expected, rtol=tolerance, atol=tolerance)


@pytest.mark.parametrize("head_dim", [16, 64, 128, 256])
def test_prefill_attention_with_bfloat16_products(head_dim):
    """bf16_dot rounds q * scale, k, the probabilities and v to bfloat16: on inputs that are bfloat16
    values already (and a power-of-two scale) only the probabilities round, so the output is within
    their rounding (2^-9 relative) of exact attention; on float32 inputs, within bfloat16 rounding."""
    dot_backend = PagedAttention(NATIVE_CPU_KERNELS, head_dim)
    dot_backend.bf16_dot = True
    for query_lens, context_lens in PREFILL_STEPS:
        scale = 0.25 if head_dim <= 128 else 2**-4  # (a power of two; scores of the same spread)
        step = (query_lens, context_lens, (8, 2), head_dim, 16, scale)
        out, _ = _prefill_step(dot_backend, *step, bfloat16=True)
        expected, _ = _prefill_step(TORCH, *step, bfloat16=True)
        assert (out - expected).abs().max() <= 6e-3 and (
            out - expected
        ).abs().mean() <= 5e-4  # 3.7e-3, 2.5e-4
        out, _ = _prefill_step(dot_backend, *step)
        expected, _ = _prefill_step(TORCH, *step)
        error = (out - expected).abs()
        assert error.max() <= 5e-2 and 1e-5 <= error.mean() <= 3e-3  # measured up to 3.1e-2, 1.7e-3: rounded


def test_prefill_attention_softmax_is_exact_for_extreme_scores():
    """Large score gaps within and across blocks of keys: the running softmax stays exact."""
    native_backend = PagedAttention(NATIVE_CPU_KERNELS, 32)
    for scale in (8.0, 40.0):
        out, _ = _prefill_step(native_backend, [70], [90], (4, 2), 32, 16, scale)
        expected, _ = _prefill_step(TORCH, [70], [90], (4, 2), 32, 16, scale)
        torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-4)


def test_prefill_attention_rejects_bad_input():
    q, cache = torch.randn(10, 4, 16), torch.randn(6, 4, 2, 2, 16)
    table, lens, starts = torch.tensor([[0, 1, 2]]), torch.tensor([12]), torch.tensor([0, 10])
    attend = torch.ops.weft.paged_prefill_attention
    assert attend(q, cache, table, lens, starts, 1.0).shape == (10, 4, 16)
    with pytest.raises(RuntimeError, match="block id is outside the cache"):
        attend(q, cache, torch.tensor([[0, 1, 6]]), lens, starts, 1.0)
    with pytest.raises(RuntimeError, match="queries exceed its context"):
        attend(q, cache, table, torch.tensor([9]), starts, 1.0)
    with pytest.raises(RuntimeError, match="context its blocks"):
        attend(q, cache, table, torch.tensor([13]), starts, 1.0)
    with pytest.raises(RuntimeError, match="run from 0 to the number of query tokens"):
        attend(q, cache, table, lens, torch.tensor([0, 9]), 1.0)
    with pytest.raises(RuntimeError, match="head_dim must be 16, 32, 64, 128 or 256"):
        attend(torch.randn(10, 4, 24), torch.randn(6, 4, 2, 2, 24), table, lens, starts, 1.0)
    with pytest.raises(RuntimeError, match="kv_cache must be contiguous float32"):
        attend(q, cache.double(), table, lens, starts, 1.0)


def test_decode_attention_softmax_is_exact_for_extreme_scores():
    """Large score gaps (the exp approximation's range) still give the exact softmax."""
    q, kv_new, kv_cache, meta = _random_paged_batch([9, 30], 2, 2, torch.float32)
    out = NATIVE(q * 40, kv_new, kv_cache, meta, 1.0)
    group = meta.groups[0]
    for b, n in enumerate([9, 30]):
        rows = kv_cache[group.block_table[b]].flatten(0, 1)[:n]  # [n, 2, KVH, D]
        scores = torch.einsum("hd,nhd->hn", q[b].double() * 40, rows[:, 0].double())
        expected = torch.einsum("hn,nhd->hd", scores.softmax(-1), rows[:, 1].double())
        torch.testing.assert_close(out[b].view(2, 16).double(), expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("tokens", [1, 7, 600])
def test_kv_write_puts_each_token_at_its_slot(tokens):
    """write_kv_ from the k|v columns of a q|k|v output (strided rows) against index_copy_ of the
    same rows, the cache's other slots untouched; slots out of range and bad layouts refused."""
    gen = torch.Generator().manual_seed(tokens)
    cache = torch.randn(80, 16, 2, 3, 8, generator=gen)  # [blocks, block_size, 2, KVH, D]
    qkv = torch.randn(tokens, 9 + 6, 8, generator=gen)  # 9 query heads, then 3 key and 3 value heads
    kv = qkv[:, 9:].view(tokens, 2, 3, 8)
    slots = torch.randperm(80 * 16, generator=gen)[:tokens]
    expected = cache.clone()
    expected.view(-1, 2, 3, 8).index_copy_(0, slots, kv)
    NATIVE_CPU_KERNELS.write_kv_(cache, kv, slots)
    assert torch.equal(cache, expected)
    with pytest.raises(RuntimeError, match="slot 1280 is outside the KV cache"):
        torch.ops.weft.write_kv_(cache, kv[:1], torch.tensor([80 * 16]))
    with pytest.raises(RuntimeError, match="slots must be \\[T\\] int64, one per token"):
        torch.ops.weft.write_kv_(cache, kv[:1], torch.tensor([0, 1]))
    with pytest.raises(RuntimeError, match="each token's keys and values contiguous"):
        torch.ops.weft.write_kv_(cache, kv.transpose(2, 3), slots)


@pytest.mark.parametrize("use_rows", [True, False])
def test_bitmask_kernel_matches_torch(use_rows):
    gen = torch.Generator().manual_seed(3)
    vocab, num_words = 1000, 32  # 24 bits of the last word are past the vocabulary
    bitmask = torch.randint(-(2**31), 2**31 - 1, (3, num_words), generator=gen, dtype=torch.int64).to(
        torch.int32
    )
    bitmask[1, :10] = -1  # words that allow everything take the kernel's shortcut
    logits = torch.randn(5 if use_rows else 3, vocab, generator=gen)
    rows = torch.tensor([4, 0, 2]) if use_rows else None
    native_out, torch_out = logits.clone(), logits.clone()
    NATIVE_CPU_KERNELS.apply_token_bitmask_(native_out, bitmask, rows)
    TORCH_KERNELS.apply_token_bitmask_(torch_out, bitmask, rows)
    assert torch.equal(native_out, torch_out)
    assert native_out.isinf().any() and not native_out[1 if use_rows else 0].isinf().all()


def test_bitmask_kernel_disallows_tokens_past_the_mask():
    logits = torch.zeros(2, 70)
    torch.ops.weft.apply_token_bitmask_(logits, torch.full((2, 2), -1, dtype=torch.int32), torch.empty(0))
    assert torch.isfinite(logits[:, :64]).all() and torch.isinf(logits[:, 64:]).all()


def test_silu_mul_matches_torch():
    gen = torch.Generator().manual_seed(1)
    gate_up = torch.randn(5, 2 * 300, generator=gen) * 6  # 300: vectors of 16 and a tail of 12
    gate_up[0, :4] = torch.tensor([-100.0, 100.0, 0.0, -0.0])  # exp's range ends, and zero
    gate, up = gate_up.split(300, dim=-1)
    expected = torch.nn.functional.silu(gate) * up
    torch.testing.assert_close(TORCH_KERNELS.silu_mul(gate_up), expected)
    out = NATIVE_CPU_KERNELS.silu_mul(gate_up)
    torch.testing.assert_close(out, expected, rtol=1e-6, atol=1e-6)
    strided = torch.ops.weft.silu_mul(torch.cat([gate_up, gate_up], dim=1)[:, :600])  # rows 1200 apart
    torch.testing.assert_close(strided, expected, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_add_normed_is_the_norm_the_add_and_the_next_norm(dtype):
    """A post-norm residual (Gemma, OLMo 2) in one pass: bit for bit what the separate norm, the
    in-place add and the next norm compute, with and without the next norm."""
    gen = torch.Generator().manual_seed(3)
    x, delta = (torch.randn(7, 130, generator=gen).to(dtype) for _ in range(2))
    w_delta, w_next = (torch.rand(130, generator=gen).to(dtype) + 0.5 for _ in range(2))
    expected_x = x + NATIVE_CPU_KERNELS.rms_norm(delta, w_delta, 1e-6)
    expected = NATIVE_CPU_KERNELS.rms_norm(expected_x, w_next, 1e-6)
    fused_x = x.clone()
    out = NATIVE_CPU_KERNELS.add_normed_(fused_x, delta, w_delta, w_next, 1e-6)
    assert torch.equal(fused_x, expected_x) and torch.equal(out, expected)
    alone = x.clone()
    assert NATIVE_CPU_KERNELS.add_normed_(alone, delta, w_delta, None, 1e-6) is alone
    assert torch.equal(alone, expected_x)
    torch_x = x.clone()
    torch.testing.assert_close(TORCH_KERNELS.add_normed_(torch_x, delta, w_delta, w_next, 1e-6), expected)


def test_gelu_mul_matches_torch():
    """GeGLU with tanh's GELU (Gemma): x * sigmoid(2u) for 0.5 x (1 + tanh(u)), every lane width and
    a tail, exp's range ends and zero."""
    gen = torch.Generator().manual_seed(2)
    gate_up = torch.randn(5, 2 * 300, generator=gen) * 4
    gate_up[0, :5] = torch.tensor([-100.0, 100.0, 0.0, -0.0, -5.0])
    gate, up = gate_up.split(300, dim=-1)
    expected = torch.nn.functional.gelu(gate, approximate="tanh") * up
    torch.testing.assert_close(TORCH_KERNELS.gelu_mul(gate_up), expected)
    torch.testing.assert_close(NATIVE_CPU_KERNELS.gelu_mul(gate_up), expected, rtol=2e-6, atol=2e-6)
    strided = torch.ops.weft.gelu_mul(torch.cat([gate_up, gate_up], dim=1)[:, :600])  # rows 1200 apart
    torch.testing.assert_close(strided, expected, rtol=2e-6, atol=2e-6)


@pytest.mark.parametrize("rows", [1, 3, 5, 6, 8, 12, 13, 16, 40])
@pytest.mark.parametrize("last", [5, 21])
@pytest.mark.parametrize("bias", [True, False])
def test_packed_linear_matches_f_linear(rows, last, bias):
    """Every tile height (1-12 rows with AVX-512, 1-3 whole-panel and 6-12 half-panel rows with
    AVX2, and uneven splits), a last panel of `last` columns (within its first half, or past it)."""
    gen = torch.Generator().manual_seed(rows)
    out_features, in_features = 64 + last, 40  # panels of 32, 32 and `last` columns
    weight = torch.randn(out_features, in_features, generator=gen)
    b = torch.randn(out_features, generator=gen) if bias else None
    x = torch.randn(rows, in_features, generator=gen)
    panels = torch.ops.weft.pack_linear_weight(weight)
    assert panels.shape == (3, in_features, 32) and not panels[2, :, last:].any()
    out = torch.ops.weft.packed_linear(x, panels, b, out_features)
    torch.testing.assert_close(out, torch.nn.functional.linear(x, weight, b), rtol=1e-5, atol=1e-5)


def test_packed_linear_takes_strided_and_empty_inputs():
    weight = torch.randn(64, 24)
    panels = torch.ops.weft.pack_linear_weight(weight)
    wide = torch.randn(5, 40)
    torch.testing.assert_close(
        torch.ops.weft.packed_linear(wide[:, 8:32], panels, None, 64), wide[:, 8:32] @ weight.T
    )
    transposed = torch.randn(24, 5).T  # column-major rows
    torch.testing.assert_close(
        torch.ops.weft.packed_linear(transposed, panels, None, 64), transposed @ weight.T
    )
    assert torch.ops.weft.packed_linear(torch.empty(0, 24), panels, None, 64).shape == (0, 64)


def test_linear_layouts_agree():
    """A Linear moved to each layout computes the same function, biases included."""
    gen = torch.Generator().manual_seed(0)
    weight, bias = torch.randn(50, 20, generator=gen), torch.randn(50, generator=gen)
    x = torch.randn(7, 20, generator=gen)
    expected = torch.nn.functional.linear(x, weight, bias)
    read_only = (WeightLayout.BLOCKS, WeightLayout.FILE)  # (layouts a matrix takes as it is read)
    for layout in (layout for layout in WeightLayout if layout not in read_only):
        linear = Linear(20, 50, bias=True)
        linear.weight.data, linear.bias.data = weight.clone(), bias.clone()  # type: ignore[union-attr]
        linear.set_layout(layout)
        torch.testing.assert_close(linear(x), expected, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="already in the panels layout"):
        linear.set_layout(WeightLayout.IN_OUT)
    with pytest.raises(ValueError, match="only as it is read in blocks"):  # GGUF blocks come from a file
        Linear(20, 50).set_layout(WeightLayout.BLOCKS)
    with pytest.raises(ValueError, match="only as it is read from a GGUF file"):
        Linear(20, 50).set_layout(WeightLayout.FILE)


def test_weight_layout_by_device_and_dtype(monkeypatch):
    cpu = torch.device("cpu")
    assert kernels_for(cpu) is NATIVE_CPU_KERNELS
    assert weight_layout(NATIVE_CPU_KERNELS, cpu, torch.float32) is WeightLayout.PANELS
    assert weight_layout(NATIVE_CPU_KERNELS, cpu, torch.bfloat16) is WeightLayout.PANELS
    assert weight_layout(TORCH_KERNELS, cpu, torch.bfloat16) is WeightLayout.OUT_IN
    assert weight_layout(TORCH_KERNELS, torch.device("cuda"), torch.float32) is WeightLayout.OUT_IN
    assert weight_layout(TORCH_KERNELS, cpu, torch.float32) is WeightLayout.IN_OUT
    monkeypatch.setitem(native._state, "ok", False)
    assert kernels_for(cpu) is TORCH_KERNELS


def test_kernels_reject_bad_input():
    q, _, kv_cache, meta = _random_paged_batch([5], 4, 2, torch.float32)
    group = meta.groups[0]
    with pytest.raises(RuntimeError, match="context length exceeds the block table"):
        torch.ops.weft.paged_decode_attention(q, kv_cache, group.block_table, group.context_lens + 100, 1.0)
    with pytest.raises(RuntimeError, match="kv_cache must be contiguous"):
        torch.ops.weft.paged_decode_attention(
            q, kv_cache.double(), group.block_table, group.context_lens, 1.0
        )
    with pytest.raises(RuntimeError, match="weight must be"):
        torch.ops.weft.rms_norm(torch.randn(2, 8), torch.ones(4), 1e-6)
    with pytest.raises(RuntimeError, match="x and delta must be contiguous"):
        torch.ops.weft.add_rms_norm_(torch.randn(2, 8), torch.randn(2, 4), torch.ones(8), 1e-6)
    panels = torch.ops.weft.pack_linear_weight(torch.randn(64, 24))
    with pytest.raises(RuntimeError, match="differ in input features"):
        torch.ops.weft.packed_linear(torch.randn(2, 16), panels, None, 64)
    with pytest.raises(RuntimeError, match="out_features does not match"):
        torch.ops.weft.packed_linear(torch.randn(2, 24), panels, None, 65)
    with pytest.raises(RuntimeError, match="x must be a float32"):
        torch.ops.weft.packed_linear(torch.randn(2, 24).bfloat16(), panels, None, 64)
    with pytest.raises(RuntimeError, match="gate_up must be"):
        torch.ops.weft.silu_mul(torch.randn(2, 7))
    with pytest.raises(RuntimeError, match="gate_up must be float32"):
        torch.ops.weft.silu_mul(torch.randn(2, 8).bfloat16())
    with pytest.raises(RuntimeError, match="row index out of range"):
        torch.ops.weft.apply_token_bitmask_(
            torch.zeros(2, 32), torch.zeros(1, 1, dtype=torch.int32), torch.tensor([5])
        )


def test_kernels_reject_out_of_range_indices():
    """Indices that would read outside a tensor are rejected before any memory is touched."""
    q, _, kv_cache, meta = _random_paged_batch([5, 9], 4, 2, torch.float32)
    group = meta.groups[0]
    bad_table = group.block_table.clone()
    bad_table[1, 0] = kv_cache.shape[0]  # one past the last block
    with pytest.raises(RuntimeError, match="block id is outside the cache"):
        torch.ops.weft.paged_decode_attention(q, kv_cache, bad_table, group.context_lens, 1.0)
    with pytest.raises(RuntimeError, match="empty dimension"):
        torch.ops.weft.paged_decode_attention(
            q[:, :0], kv_cache[:, :, :, :0].contiguous(), group.block_table, group.context_lens, 1.0
        )
    cos, sin = torch.ones(16, 8), torch.zeros(16, 8)
    with pytest.raises(RuntimeError, match="outside the cos/sin tables"):
        torch.ops.weft.rope_(torch.randn(2, 3, 16), torch.tensor([0, 16]), cos, sin, 3)
    with pytest.raises(RuntimeError, match=r"\[P, D / 2\]"):
        torch.ops.weft.rope_(torch.randn(2, 3, 16), torch.tensor([0, 1]), torch.ones(16, 4), sin, 3)
    with pytest.raises(RuntimeError, match="rows must be"):
        torch.ops.weft.apply_token_bitmask_(
            torch.zeros(4, 32), torch.zeros(2, 1, dtype=torch.int32), torch.tensor([[0, 1]])
        )
    misaligned = torch.empty(2 * 24 * 32 + 1)[1:].view(2, 24, 32)
    with pytest.raises(RuntimeError, match="64-byte aligned"):
        torch.ops.weft.packed_linear(torch.randn(2, 24), misaligned, None, 64)


def test_kernels_at_many_threads():
    """The kernels split their work by thread count: the same results with 16 threads as with the
    machine's, and the same rejections."""
    before = torch.get_num_threads()
    torch.set_num_threads(16)
    try:
        test_kernels_reject_bad_input()
        test_kernels_reject_out_of_range_indices()
        test_decode_attention_matches_gather_and_sdpa(torch.float32, (8, 2))
        test_short_multi_token_rows_attend_token_by_token()
        test_prefill_attention_matches_gather_and_sdpa(64, (8, 2), 16)
        test_prefill_attention_with_bfloat16_products(64)
        test_prefill_attention_rejects_bad_input()
        for rows in (1, 13, 40):
            test_packed_linear_matches_f_linear(rows, 21, True)
        test_bitmask_kernel_matches_torch(True)
    finally:
        torch.set_num_threads(before)


@pytest.mark.sanitize
def test_native_tests_pass_under_address_and_undefined_behaviour_sanitizers(tmp_path):
    """Opt-in (`pytest -m sanitize`, a few minutes): build the kernels with ASan and UBSan and run
    this file's tests against that build in a child process, with the sanitizer runtime preloaded."""
    import subprocess
    import sys

    libs = [
        subprocess.run(["g++", f"-print-file-name={name}"], capture_output=True, text=True).stdout.strip()
        for name in ("libasan.so", "libubsan.so")
    ]
    env = {
        **os.environ,
        "CI": "true",  # the child fails, rather than skips, if the sanitized kernels do not load
        "WEFT_NATIVE_SANITIZE": "1",
        "WEFT_CACHE_DIR": str(tmp_path),
        "LD_PRELOAD": " ".join(libs),
        "ASAN_OPTIONS": "detect_leaks=0:abort_on_error=1",
        "UBSAN_OPTIONS": "print_stacktrace=1:halt_on_error=1",
    }
    test_file = str(Path(__file__))
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "not sanitize", test_file]
    result = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1200)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    assert any(tmp_path.iterdir()), "the sanitized build was not made"
    assert " passed" in result.stdout and " skipped" not in result.stdout, result.stdout[-2000:]


def test_model_output_is_the_same_with_and_without_kernels(tiny_llama, monkeypatch):
    from weft import LLM, SamplingParams

    llm = LLM(str(tiny_llama), show_progress=False, device="cpu", dtype="float32")
    assert llm.engine.model.lm_head.layout is WeightLayout.PANELS
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, logprobs=2)
    prompts = [[5, 6, 7, 8, 9], [3] * 21, [11, 12]]
    with_kernels = llm.generate(prompts, params, use_tqdm=False)
    monkeypatch.setitem(native._state, "ok", False)  # loads with [in, out] weights, runs plain torch
    without = LLM(str(tiny_llama), show_progress=False, device="cpu", dtype="float32")
    without_outputs = without.generate(prompts, params, use_tqdm=False)
    for a, b in zip(with_kernels, without_outputs, strict=True):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert a.outputs[0].cumulative_logprob == pytest.approx(b.outputs[0].cumulative_logprob, abs=1e-4)


@pytest.mark.parametrize(
    "arch", ["llama", "qwen2", "qwen3", "granite", "smollm3", "gemma3", "gemma2", "phi3", "mistral_window"]
)
def test_decoder_stack_in_one_call_equals_layer_by_layer(checkpoint_factory, arch):
    """Single-query steps run all layers in one `decoder_stack_` call; identical results to the
    layer-by-layer path, also for short prompts taken token by token in the stack (5 and 2 tokens,
    one step) beside a long one (21 tokens, the SDPA path). qwen2 has q/k/v biases; granite its
    four scales (the residual one in the stack); qwen3 its per-head q/k norms; smollm3 a layer
    without rotary embedding; gemma3 norms around each branch, GeGLU, windows of 8 keys in a pool of
    their own with a rotation of their own; gemma2 soft-capped scores; phi3 a partial rotation;
    mistral a window of 8 keys in every layer."""
    from weft import LLM, SamplingParams

    overrides = {"sliding_window": 8} if arch == "mistral_window" else {}
    path = str(checkpoint_factory(arch.removesuffix("_window"), **overrides))
    # blocks of 4 tokens: rows cross blocks, and windows leave blocks behind, within the test
    fused, layered = (
        LLM(path, show_progress=False, device="cpu", dtype="float32", block_size=4) for _ in "ab"
    )
    assert fused.engine.model.stack is not None
    layered.engine.model.stack = None
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, logprobs=2)
    for prompts in ([[5, 6, 7, 8, 9], [11, 12]], [[5, 6, 7, 8, 9], [3] * 21, [11, 12]]):
        outs = [llm.generate(prompts, params, use_tqdm=False) for llm in (fused, layered)]
        for a, b in zip(*outs, strict=True):
            assert a.outputs[0].token_ids == b.outputs[0].token_ids
            assert a.outputs[0].logprobs == b.outputs[0].logprobs


def assert_the_stack_computes_the_layers_numbers(path: str, **options) -> None:
    """Two engines on one model, one with the fused stack and one without: the same greedy tokens and
    logprobs, a row alone and a batch with a prompt of 21 tokens (blocks of 4)."""
    from weft import LLM, SamplingParams

    fused, layered = (LLM(path, show_progress=False, block_size=4, **options) for _ in "ab")
    assert fused.engine.model.stack is not None
    layered.engine.model.stack = None
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, logprobs=2)
    for prompts in ([[5, 6, 7]], [[5, 6, 7, 8, 9], [3] * 21, [11, 12]]):
        outs = [llm.generate(prompts, params, use_tqdm=False) for llm in (fused, layered)]
        for a, b in zip(*outs, strict=True):
            assert a.outputs[0].token_ids == b.outputs[0].token_ids
            assert a.outputs[0].logprobs == b.outputs[0].logprobs


@pytest.mark.parametrize("arch", ["qwen3moe", "qwen2moe", "mixtral"])
def test_decoder_stack_runs_experts_with_the_layer_paths_numbers(checkpoint_factory, arch):
    """A mixture of experts in the stack (weft/native/experts.cpp): Qwen3-MoE's normalized top 2 of
    8, Qwen2-MoE's shared expert and its gate, Mixtral's w1/w2/w3 experts, each quantized to Q8_0 at
    load (dot panels, which the stack takes). A row alone takes its experts in two grouped products,
    several rows are grouped by expert: greedy tokens and logprobs equal to the layer path's."""
    path = str(checkpoint_factory(arch))
    assert_the_stack_computes_the_layers_numbers(path, dtype="float32", quantization="q8_0")


@pytest.mark.parametrize(("arch", "mix"), [("gptoss", "mxfp4"), ("qwen3moe", "q4_k_m")])
def test_decoder_stack_runs_a_gguf_files_experts_with_the_layer_paths_numbers(
    checkpoint_factory, tmp_path, arch, mix
):
    """Random GGUF files: gpt-oss's MXFP4 experts with their biases and clamped SwiGLU, its attention
    sinks, q/k/v and o biases and sliding-window layers; Qwen3-MoE's Q4_K_M mix. The stack's tokens
    and logprobs are the layer path's."""
    from weft.bench.random_gguf import word_level_tokenizer, write_random_gguf

    config = checkpoint_factory(arch) / "config.json"
    path = write_random_gguf(config, mix, tmp_path / "random.gguf", num_layers=2)
    tokenizer = str(word_level_tokenizer(384, tmp_path / "tokenizer"))
    assert_the_stack_computes_the_layers_numbers(str(path), tokenizer=tokenizer)


def test_decoder_stack_leaves_experts_it_cannot_run_to_the_layers(checkpoint_factory):
    """Float experts (not dot panels) keep the layer path."""
    from weft import LLM

    llm = LLM(str(checkpoint_factory("qwen3moe")), show_progress=False, dtype="float32")
    assert llm.engine.model.stack is None


def test_decoder_stack_rejects_a_slot_outside_the_cache(tiny_llama):
    from weft import LLM

    model = LLM(str(tiny_llama), show_progress=False, device="cpu", dtype="float32").engine.model
    assert model.stack is not None
    caches = [torch.zeros(2, 4, 2, 2, 16) for _ in model.layers]
    x = torch.randn(1, 64)
    table, lens, positions = (
        torch.zeros(1, 1, dtype=torch.long),
        torch.ones(1, dtype=torch.long),
        torch.zeros(1, dtype=torch.long),
    )
    cos, sin = [model.rotary.cos], [model.rotary.sin]
    with pytest.raises(RuntimeError, match=r"decoder_stack_: slot 8 is outside the KV cache \(8 slots\)"):
        torch.ops.weft.decoder_stack_(
            x,
            model.stack,
            caches,
            torch.tensor([8]),
            table,
            lens,
            positions,
            cos,
            sin,
            [4, 2, 16, 64, 128],
            1e-6,
            0.25,
            False,  # bf16_dot
            1.0,  # residual_scale
            [],  # layer_rope
            False,  # sandwich
            False,  # gelu
            0.0,  # softcap
            [],  # layer_window
            [],  # window_meta
        )


def test_disabled_by_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("WEFT_NATIVE", "0")
    monkeypatch.setenv("WEFT_CACHE_DIR", str(tmp_path))
    assert native._load(native.NativeConfig.from_env()) is False
    assert not any(tmp_path.iterdir())


@pytest.mark.parametrize("num_top", [0, 1, 5, 20, 40])
def test_top_by_value_then_index_matches_torch(num_top):
    """The one-pass kernel keeps the same tokens in the same order as the static-shape torch
    version: ties to the smaller index, NaN as -inf, rows of -inf included."""
    gen = torch.Generator().manual_seed(num_top)
    x = torch.randint(-4, 4, (7, 40), generator=gen).float()  # many ties
    x[1] = float("-inf")
    x[2, 3] = float("nan")
    x[3, :30] = float("-inf")
    native_ids, native_values = NATIVE_CPU_KERNELS.top_by_value_then_index(x, num_top)
    torch_ids, torch_values = TORCH_KERNELS.top_by_value_then_index(x, num_top)
    assert torch.equal(native_ids, torch_ids)
    torch.testing.assert_close(native_values, torch_values, equal_nan=True)
    strided = torch.cat([x, x], dim=1)[:, :40]
    assert torch.equal(NATIVE_CPU_KERNELS.top_by_value_then_index(strided, num_top)[0], torch_ids)
    with pytest.raises(RuntimeError, match="num_top"):
        torch.ops.weft.top_by_value_then_index(x, 41)


def test_rank_of_matches_torch():
    gen = torch.Generator().manual_seed(4)
    x = torch.randint(-3, 3, (5, 30), generator=gen).float()
    ids = torch.tensor([0, 3, 7, 29, 12])
    assert torch.equal(NATIVE_CPU_KERNELS.rank_of(x, ids), TORCH_KERNELS.rank_of(x, ids))
    with pytest.raises(RuntimeError, match="outside the row"):
        torch.ops.weft.rank_of(x, torch.tensor([0, 0, 0, 0, 30]))


@pytest.mark.parametrize("num_top", [0, 1, 5, 20, 40])
@pytest.mark.parametrize("vocab", [40, 100])
def test_row_logprobs_matches_torch(num_top, vocab):
    """The fused kernel (log-normalizer, then one pass for rank and top-n) gives the tokens, ranks
    and logprobs of log_softmax + gather: ties (integer logits) to the smaller id, -inf entries,
    a NaN row, widths with and without a tail past the 16-lane loop, and a given normalizer."""
    gen = torch.Generator().manual_seed(num_top + vocab)
    x = torch.randint(-4, 4, (7, vocab), generator=gen).float()
    x[1, : vocab // 2] = float("-inf")
    x[2, 3] = float("nan")
    ids = torch.randint(0, vocab, (7,), generator=gen)
    ids[1] = vocab - 1  # a finite entry
    num_top = min(num_top, vocab)
    for norm in (None, torch.randn(7, generator=gen)):
        native = NATIVE_CPU_KERNELS.row_logprobs(x, ids, num_top, norm)
        reference = TORCH_KERNELS.row_logprobs(x, ids, num_top, norm)
        assert torch.equal(native[0], reference[0]) and torch.equal(native[2], reference[2])
        torch.testing.assert_close(native[1], reference[1], equal_nan=True)
    with pytest.raises(RuntimeError, match="outside the row"):
        torch.ops.weft.row_logprobs(x, torch.full((7,), vocab), 1, torch.empty(0))


@pytest.mark.parametrize("vocab", [40, 100, 49152])
def test_constraint_logmass_matches_torch(vocab):
    """The two-pass kernel gives log(allowed mass) as the tensor version does, in float64: rows
    whose allowed tokens hold most of the mass, almost none of it (e^-120, where exp's clamp at -87
    would lose it without the third pass), none at all (-inf), a NaN row, -inf logits among the
    allowed ones, row indices, and widths with and without a tail past the vector loop."""
    gen = torch.Generator().manual_seed(vocab)
    raw = torch.randn(8, vocab, generator=gen) * 3  # [R, V]
    masked = torch.where(torch.rand(9, vocab, generator=gen) < 0.3, 0.0, float("-inf"))  # [B, V]
    masked[:, 0] = 0.0
    rows = torch.tensor([0, 1, 2, 3, 4, 5, 6, 8])
    raw[1, 0] = 40.0  # an allowed token with most of the mass
    raw[2] = torch.where(masked[2] > float("-inf"), raw[2] - 120.0, raw[2])  # allowed mass ~ e^-120
    masked[3] = float("-inf")  # nothing allowed
    raw[4, vocab // 2] = float("nan")
    raw[5, ::2] = float("-inf")  # -inf logits, some of them allowed
    native = NATIVE_CPU_KERNELS.constraint_logmass(raw, masked, rows)
    reference = TORCH_KERNELS.constraint_logmass(raw.double(), masked.double(), rows).float()
    torch.testing.assert_close(native, reference, atol=2e-5, rtol=1e-6, equal_nan=True)
    assert native[3] == float("-inf") and native[4].isnan() and -125 < native[2] < -115
    same_rows = NATIVE_CPU_KERNELS.constraint_logmass(raw, masked[rows], None)
    assert torch.equal(same_rows.nan_to_num(), native.nan_to_num())
    with pytest.raises(RuntimeError, match="outside masked"):
        torch.ops.weft.constraint_logmass(raw, masked, torch.full((8,), 9))


def test_gumbel_argmax_samples_the_tokens_of_the_tensor_version():
    """The one-pass kernel draws the same keyed noise as `ops.gumbel_sample` (bit for bit before the
    logs), so it picks the same tokens: flat rows (the noise alone decides), wide rows (most tokens
    out of reach, skipped), masked and all -inf rows, and a width with a tail past the 16 lanes."""
    gen = torch.Generator().manual_seed(3)
    for rows, vocab, scale in [(3000, 64, 0.0), (400, 1000, 1.0), (200, 517, 40.0)]:
        logits = torch.randn(rows, vocab, generator=gen) * scale
        logits[0, : vocab // 2] = float("-inf")
        logits[1] = float("-inf")
        seeds = torch.randint(0, 2**62, (rows,), generator=gen)
        positions = torch.randint(0, 4096, (rows,), generator=gen)
        native = NATIVE_CPU_KERNELS.gumbel_argmax(logits, seeds, positions)
        assert torch.equal(native, ops.gumbel_sample(logits, seeds, positions)), (rows, vocab, scale)
        assert native[0] >= vocab // 2 and native[1] == 0
    assert torch.equal(TORCH_KERNELS.gumbel_argmax(logits, seeds, positions), native)  # the tensor version


@pytest.mark.parametrize("vocab", [1, 7, 16, 37, 4096, 128256])
def test_row_max_is_torch_max(vocab):
    """The greedy token and the row's largest value, as torch.max(dim=-1) gives them: the first
    index on ties (repeated maxima, +0 and -0), a NaN row's first NaN, all -inf rows, a row whose
    maximum is in the tail past the last full vector, and rows that are a view with a stride."""
    gen = torch.Generator().manual_seed(vocab)
    x = torch.randn(9, vocab + 3, generator=gen)[:, :vocab]  # rows strided by vocab + 3
    x[1] = float("-inf")
    x[2, vocab // 2 :] = float("nan")
    x[3] = x[3].round()  # many ties at the maximum
    x[4] = 0.0
    x[4, vocab // 3 :] = -0.0
    x[5, -1] = 1e9  # the maximum in the tail
    x[6, vocab // 2] = float("inf")
    values, ids = NATIVE_CPU_KERNELS.row_max(x)
    expected_values, expected_ids = x.max(dim=-1)
    assert torch.equal(ids, expected_ids)
    assert torch.equal(values.nan_to_num(), expected_values.nan_to_num())
    assert torch.equal(values.isnan(), expected_values.isnan())
    assert torch.equal(values.signbit(), expected_values.signbit())


def _top_p_reference(logits: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Keep token j iff the float64 probability mass of the tokens strictly more likely is below
    top_p (ties at the cut stay whole); rows with top_p = 1 or a NaN are left as they are."""
    probs = torch.softmax(logits.double(), dim=-1)  # [B, V]
    above = (probs[:, None, :] * (logits[:, None, :] > logits[:, :, None])).sum(-1)  # [B, V]
    keep = (above < top_p.double()[:, None]) | (top_p[:, None] >= 1) | logits.isnan().any(-1, keepdim=True)
    return logits.masked_fill(~keep, float("-inf"))


@pytest.mark.parametrize("vocab", [37, 300])
def test_top_p_filter_keeps_the_exact_nucleus(vocab):
    """Against the float64 definition: integer logits (ties at the cut), -inf tokens, a NaN row
    (left for the sampler to report), rows with top_p = 1, and an all -inf row."""
    gen = torch.Generator().manual_seed(vocab)
    logits = torch.cat(
        [torch.randint(-3, 4, (6, vocab), generator=gen).float(), torch.randn(6, vocab, generator=gen)]
    )
    logits[1, : vocab // 3] = float("-inf")
    logits[2, 5] = float("nan")
    logits[3] = float("-inf")
    top_p = torch.rand(12, generator=gen) * 0.9 + 0.05
    top_p[4] = 1.0
    filtered = NATIVE_CPU_KERNELS.top_p_filter(logits, top_p)
    torch.testing.assert_close(filtered, _top_p_reference(logits, top_p), equal_nan=True)
    finite = ~logits.isnan().any(-1)  # the tensor version, the same rule:
    expected = _top_p_reference(logits, top_p)[finite]
    torch.testing.assert_close(TORCH_KERNELS.top_p_filter(logits, top_p)[finite], expected)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_long_prefill_runs_its_mlp_in_chunks_with_the_same_result(checkpoint_factory, monkeypatch, dtype):
    """A step with more rows than `mlp_chunk_rows` runs the MLP a chunk of rows at a time (its
    [T, 2I] intermediate stays small; with bfloat16 products, where gate|up runs fused with its
    activation, from `GLU_CHUNK_BYTES` of activations): every row computes exactly what it computes
    unchunked, since the panel kernel computes each row on its own."""
    from weft import LLM, SamplingParams
    from weft.model import llama
    from weft.model.llama import MLP

    path = str(checkpoint_factory("llama", dtype=dtype))
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True, prompt_logprobs=2)
    prompts = [list(range(5, 45)), list(range(50, 63))]
    options = {"show_progress": False, "device": "cpu", "dtype": dtype}
    whole = LLM(path, **options).generate(prompts, params, use_tqdm=False)
    monkeypatch.setattr(type(NATIVE_CPU_KERNELS), "mlp_chunk_rows", 7)
    monkeypatch.setattr(llama, "GLU_CHUNK_BYTES", 0)  # bfloat16 products: the fused MLP's own bound
    chunks: list[int] = []
    forward = MLP._forward
    monkeypatch.setattr(MLP, "_forward", lambda mlp, x, r: chunks.append(x.shape[0]) or forward(mlp, x, r))
    chunked = LLM(path, **options).generate(prompts, params, use_tqdm=False)
    assert max(chunks) == 7 and 53 % 7 in chunks  # the 53-row prefill step, in chunks
    for a, b in zip(whole, chunked, strict=True):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert a.prompt_logprobs == b.prompt_logprobs and a.outputs[0].logprobs == b.outputs[0].logprobs
