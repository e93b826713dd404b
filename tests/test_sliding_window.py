"""Sliding-window attention in every path against a direct reference: a query at position p sees
keys p - W + 1 .. p (W keys, itself included, as transformers and llama.cpp count them). The native
CPU kernels (decode, token by token, prefill in place), the gather + SDPA path with masks, Triton's
ragged and split-decode kernels (in its interpreter off CUDA) and the scoring tree's masks. Then
attention sinks (gpt-oss: a logit per head in each softmax's sum, with no value) in the same paths,
with and without windows, and Gemma 2's soft-capped scores."""

from __future__ import annotations

import random

import pytest
import torch

from weft.kernels import NATIVE_CPU_KERNELS, TORCH_KERNELS
from weft.model.attention import (
    PagedAttention,
    build_attention_metadata,
    build_tree_metadata,
    paged_attention,
)


def _tables(context_lens: list[int], block_size: int, seed: int) -> tuple[list[list[int]], int]:
    """Block tables drawn from a shuffled pool, and the pool's size."""
    needed = [-(-ctx // block_size) for ctx in context_lens]
    pool = list(range(1, sum(needed) + 2))
    random.Random(seed).shuffle(pool)
    tables, start = [], 0
    for count in needed:
        tables.append(pool[start : start + count])
        start += count
    return tables, len(pool) + 1


def _step(query_lens, context_lens, heads, head_dim, block_size, seed=0):
    """q [T, H, D], the step's k|v [T, 2, KVH, D], a cache and block tables."""
    num_heads, num_kv_heads = heads
    tables, num_blocks = _tables(context_lens, block_size, seed)
    gen = torch.Generator().manual_seed(seed)
    cache = torch.randn(num_blocks, block_size, 2, num_kv_heads, head_dim, generator=gen)
    q = torch.randn(sum(query_lens), num_heads, head_dim, generator=gen)
    kv = torch.randn(sum(query_lens), 2, num_kv_heads, head_dim, generator=gen)
    return q, kv, cache, tables


def _reference(q, kv, cache, tables, query_lens, context_lens, window, scale, sinks=None, softcap=0.0):
    """Each token's attention over the keys in its window, one token at a time, in float64 (with
    each head's sink logit in the softmax's sum where given)."""
    cache = cache.clone().double()
    block_size, group = cache.shape[1], q.shape[1] // cache.shape[3]
    out, token = [], 0
    for table, q_len, ctx in zip(tables, query_lens, context_lens, strict=True):
        for i in range(q_len):  # write the step's keys and values first
            pos = ctx - q_len + i
            cache[table[pos // block_size], pos % block_size] = kv[token + i].double()
        rows = cache[table].flatten(0, 1)  # [blocks * bs, 2, KVH, D]
        for i in range(q_len):
            pos = ctx - q_len + i
            low = max(0, pos - window + 1) if window else 0
            keys = rows[low : pos + 1, 0].repeat_interleave(group, dim=1)  # [n, H, D]
            values = rows[low : pos + 1, 1].repeat_interleave(group, dim=1)
            scores = torch.einsum("hd,nhd->hn", q[token + i].double() * scale, keys)
            if softcap:
                scores = softcap * torch.tanh(scores / softcap)
            if sinks is not None:
                scores = torch.cat([scores, sinks.double()[:, None]], dim=1)  # [H, n + 1]
            probs = scores.softmax(-1)[:, : keys.shape[0]]
            out.append(torch.einsum("hn,nhd->hd", probs, values).flatten())
        token += q_len
    return torch.stack(out)


DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")  # Triton's: its interpreter off CUDA


def _triton_step(query_lens, context_lens, seed):
    """`_step` for the Triton kernels: the tensors on their device, the block tables as lists."""
    q, kv, cache, tables = _step(query_lens, context_lens, (4, 2), 16, 16, seed=seed)
    return q.to(DEVICE), kv.to(DEVICE), cache.to(DEVICE), tables


STEPS = [  # (query_lens, context_lens): decode rows, short rows, prompt chunks and whole prompts
    ([1, 1, 1], [3, 17, 70]),
    ([1, 3, 8, 20, 1, 40], [9, 12, 8, 29, 70, 100]),
    ([37], [37]),
    ([64, 5], [64, 90]),
]


@pytest.mark.parametrize("name,kernels", [("sdpa", TORCH_KERNELS), ("native", NATIVE_CPU_KERNELS)])
@pytest.mark.parametrize("window", [1, 5, 16, 33])
@pytest.mark.parametrize("steps", STEPS)
def test_windowed_attention_matches_the_reference(name, kernels, window, steps):
    query_lens, context_lens = steps
    for heads, head_dim, block_size in (((4, 2), 32, 16), ((3, 3), 16, 4), ((8, 2), 64, 16)):
        q, kv, cache, tables = _step(query_lens, context_lens, heads, head_dim, block_size, seed=window)
        backend = PagedAttention(kernels, head_dim, heads[0] // heads[1], heads[0], window)
        meta, _ = backend.build_metadata(query_lens, context_lens, tables, block_size, q.device)
        out = backend(q, kv, cache, meta.windowed(window), head_dim**-0.5)
        expected = _reference(
            q.cpu(), kv.cpu(), cache.cpu(), tables, query_lens, context_lens, window, head_dim**-0.5
        )
        torch.testing.assert_close(out.double(), expected, rtol=2e-5, atol=2e-5, msg=name)
        full = backend(q, kv, cache.clone(), meta, head_dim**-0.5)  # the same step's global layers
        expected = _reference(
            q.cpu(), kv.cpu(), cache.cpu(), tables, query_lens, context_lens, 0, head_dim**-0.5
        )
        torch.testing.assert_close(full.double(), expected, rtol=2e-5, atol=2e-5, msg=name)


def test_windowed_metadata_is_refused_where_it_was_not_built():
    meta, _ = build_attention_metadata([1], [5], [[1]], 16, torch.device("cpu"))
    assert meta.windowed(0) is meta
    with pytest.raises(ValueError, match="without the window 4"):
        meta.windowed(4)
    ragged, _ = build_attention_metadata([1], [5], [[1]], 16, torch.device("cpu"), 1, True, window=4)
    assert ragged.windowed(4) is ragged.sliding and ragged.sliding.ragged.window == 4  # built once a step
    assert ragged.windowed(2).ragged.window == 2  # (a CUDA graph's metadata: derived)


@pytest.mark.parametrize("window", [1, 6, 40])
def test_triton_ragged_and_split_decode_keep_to_the_window(window):
    """Triton's ragged kernel (mixed rows) and its split decode (one sequence, many splits)."""
    pytest.importorskip("triton")
    from weft.cuda.attention import split_decode_attention
    from weft.cuda.kernels import TRITON_KERNELS

    for query_lens, context_lens in (STEPS[1], ([1], [100])):
        q, kv, cache, tables = _triton_step(query_lens, context_lens, seed=window)
        meta, _ = build_attention_metadata(query_lens, context_lens, tables, 16, DEVICE, 1, True)
        out = paged_attention(q, kv, cache.clone(), meta.windowed(window), 0.25, TRITON_KERNELS)
        expected = _reference(q.cpu(), kv.cpu(), cache.cpu(), tables, query_lens, context_lens, window, 0.25)
        torch.testing.assert_close(out.double().cpu(), expected, rtol=1e-4, atol=1e-4)
    written = cache.clone()
    TORCH_KERNELS.write_kv_(written, kv, meta.slot_mapping)  # the step's keys and values
    assert meta.ragged is not None
    split = split_decode_attention(q, written, meta.windowed(window).ragged, 0.25, splits=4)
    torch.testing.assert_close(split.flatten(1).double().cpu(), expected, rtol=1e-4, atol=1e-4)


def test_scoring_tree_keeps_sliding_layers_to_the_window():
    """A tree of two branches: a node sees its ancestors less than `window` deep above it."""
    parents = [-1, 0, 1, 2, 3, 2, 5, 6]  # 0-1-2-3-4 and 2-5-6-7
    meta, depth = build_tree_metadata(parents, [1], 16, torch.device("cpu"), window=3)
    assert depth.tolist() == [0, 1, 2, 3, 4, 3, 4, 5]
    mask = meta.windowed(3).groups[0].attn_mask[0, 0]  # [N, N]
    assert mask[7].nonzero().flatten().tolist() == [5, 6, 7]
    assert mask[4].nonzero().flatten().tolist() == [2, 3, 4]
    assert meta.groups[0].attn_mask[0, 0][7].nonzero().flatten().tolist() == [0, 1, 2, 5, 6, 7]


@pytest.mark.parametrize("name,kernels", [("sdpa", TORCH_KERNELS), ("native", NATIVE_CPU_KERNELS)])
@pytest.mark.parametrize("window", [0, 5])
@pytest.mark.parametrize("steps", STEPS)
def test_attention_sinks_match_the_reference(name, kernels, window, steps):
    query_lens, context_lens = steps
    sinks = torch.tensor([2.0, -1.0, 0.5, 4.0])  # [H]: large and small against the scores
    q, kv, cache, tables = _step(query_lens, context_lens, (4, 2), 32, 16, seed=window + 1)
    backend = PagedAttention(kernels, 32, 2, 4, window)
    meta, _ = backend.build_metadata(query_lens, context_lens, tables, 16, q.device)
    out = backend(q, kv, cache, meta.windowed(window), 32**-0.5, sinks)
    expected = _reference(
        q.cpu(), kv.cpu(), cache.cpu(), tables, query_lens, context_lens, window, 32**-0.5, sinks
    )
    torch.testing.assert_close(out.double(), expected, rtol=2e-5, atol=2e-5, msg=name)


@pytest.mark.parametrize("window", [0, 6])
def test_triton_attention_sinks_match_the_reference(window):
    pytest.importorskip("triton")
    from weft.cuda.attention import split_decode_attention
    from weft.cuda.kernels import TRITON_KERNELS

    sinks = torch.tensor([2.0, -1.0, 0.5, 4.0], device=DEVICE)
    for query_lens, context_lens in (STEPS[1], ([1], [100])):
        q, kv, cache, tables = _triton_step(query_lens, context_lens, seed=window)
        meta, _ = build_attention_metadata(query_lens, context_lens, tables, 16, DEVICE, 1, True)
        out = paged_attention(q, kv, cache.clone(), meta.windowed(window), 0.25, TRITON_KERNELS, sinks=sinks)
        expected = _reference(
            q.cpu(), kv.cpu(), cache.cpu(), tables, query_lens, context_lens, window, 0.25, sinks.cpu()
        )
        torch.testing.assert_close(out.double().cpu(), expected, rtol=1e-4, atol=1e-4)
    TORCH_KERNELS.write_kv_(cache, kv, meta.slot_mapping)
    assert meta.ragged is not None
    split = split_decode_attention(q, cache, meta.windowed(window).ragged, 0.25, 4, sinks)
    torch.testing.assert_close(split.flatten(1).double().cpu(), expected, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("name,kernels", [("sdpa", TORCH_KERNELS), ("native", NATIVE_CPU_KERNELS)])
@pytest.mark.parametrize("window", [0, 5])
@pytest.mark.parametrize("steps", STEPS)
def test_soft_capped_scores_match_the_reference(name, kernels, window, steps):
    """Scores as c * tanh(score / c) before the mask and softmax (c = 2: most scores are capped)."""
    query_lens, context_lens = steps
    q, kv, cache, tables = _step(query_lens, context_lens, (4, 2), 32, 16, seed=window + 2)
    backend = PagedAttention(kernels, 32, 2, 4, window)
    meta, _ = backend.build_metadata(query_lens, context_lens, tables, 16, q.device)
    out = backend(q * 3, kv, cache, meta.windowed(window), 32**-0.5, softcap=2.0)
    expected = _reference(
        q.cpu() * 3, kv.cpu(), cache.cpu(), tables, query_lens, context_lens, window, 32**-0.5, softcap=2.0
    )
    torch.testing.assert_close(out.double(), expected, rtol=2e-5, atol=2e-5, msg=name)
    plain = _reference(q * 3, kv, cache, tables, query_lens, context_lens, window, 32**-0.5)
    assert not torch.allclose(plain, expected, atol=1e-3)  # (the cap does change them)


def test_triton_soft_capped_scores_match_the_reference():
    pytest.importorskip("triton")
    from weft.cuda.attention import split_decode_attention
    from weft.cuda.kernels import TRITON_KERNELS

    for query_lens, context_lens in (STEPS[1], ([1], [100])):
        q, kv, cache, tables = _triton_step(query_lens, context_lens, seed=3)
        meta, _ = build_attention_metadata(query_lens, context_lens, tables, 16, DEVICE, 1, True)
        out = paged_attention(q * 3, kv, cache.clone(), meta.windowed(6), 0.25, TRITON_KERNELS, softcap=2.0)
        expected = _reference(
            q.cpu() * 3, kv.cpu(), cache.cpu(), tables, query_lens, context_lens, 6, 0.25, softcap=2.0
        )
        torch.testing.assert_close(out.double().cpu(), expected, rtol=1e-4, atol=1e-4)
    TORCH_KERNELS.write_kv_(cache, kv, meta.slot_mapping)
    assert meta.ragged is not None
    split = split_decode_attention(q * 3, cache, meta.windowed(6).ragged, 0.25, 4, softcap=2.0)
    torch.testing.assert_close(split.flatten(1).double().cpu(), expected, rtol=1e-4, atol=1e-4)
