"""Paged attention in Triton: every row of a step (decode tokens, prompt chunks, forced tokens,
mixed) in one launch, reading keys and values in place through the block table.

No gathered copy of the cache, no dense mask, no repeated K/V for grouped-query attention: a program
owns one tile of one sequence's new tokens for one KV head, and its rows are those tokens times the
query heads that share the KV head (`BLOCK_Q` tokens x `GQA` heads, padded to a power of two of at
least 16 rows, the smallest `tl.dot`). It walks the sequence's cache blocks up to the tile's last
position with an online softmax (the flash-attention recurrence), masking keys after each row's own
position (causal within the step, full over the cached context). Programs of tiles past a
sequence's new tokens return at once, so one grid serves ragged lengths.

The cache layout is `PagedAttention.kv_cache_shape`: `[num_blocks, block_size, 2, KVH, D]`, keys
and values side by side. Runs on CUDA, and on CPU tensors in Triton's interpreter
(`TRITON_INTERPRET=1`), which is how CI tests it against the SDPA path.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from weft.kernels import RaggedBatch

MIN_DOT_ROWS = 16  # tl.dot needs at least 16 rows, columns and depth
PREFILL_ROWS = 64  # rows of a program when a step has multi-token rows


@triton.jit
def _online_softmax_step(q, keys, values, visible, scale, acc, row_max, row_sum, DOT_FP32: tl.constexpr):
    """One cache block of the flash-attention recurrence: q [M, Dp], keys and values [S, Dp] in the
    cache's dtype, visible [M, S]; acc [M, Dp], row_max and row_sum [M] in float32."""
    if DOT_FP32:  # Triton's interpreter multiplies half-precision operands wrongly
        q, keys, values = q.to(tl.float32), keys.to(tl.float32), values.to(tl.float32)
    scores = tl.dot(q, tl.trans(keys), input_precision="ieee") * scale  # [M, S]
    scores = tl.where(visible, scores, float("-inf"))
    # Position 0 is visible to every row, so row_max is finite from the first block on.
    new_max = tl.maximum(row_max, tl.max(scores, 1))  # [M]
    probs = tl.exp(scores - new_max[:, None])  # [M, S]
    alpha = tl.exp(row_max - new_max)  # [M]
    row_sum = row_sum * alpha + tl.sum(probs, 1)
    probs = probs.to(values.dtype)  # P @ V in the cache's dtype
    acc = acc * alpha[:, None] + tl.dot(probs, values, input_precision="ieee")
    return acc, new_max, row_sum


@triton.jit
def _paged_attention_kernel(
    q_ptr, out_ptr, cache_ptr,  # [T, H, D], [T, H, D], [num_blocks, block_size, 2, KVH, D]
    block_table_ptr, seq_lens_ptr, query_start_ptr,  # [B, max_blocks], [B], [B + 1] int32
    scale, stride_qt, stride_qh, stride_ot, stride_oh,
    stride_cache_block, stride_cache_slot, stride_cache_kv, stride_cache_head, stride_table,
    GQA: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    BLOCK_Q: tl.constexpr, BLOCK_M: tl.constexpr, DOT_FP32: tl.constexpr,
):  # fmt: skip
    seq = tl.program_id(0)
    tile = tl.program_id(1)
    kv_head = tl.program_id(2)
    q_start = tl.load(query_start_ptr + seq)
    q_len = tl.load(query_start_ptr + seq + 1) - q_start
    if tile * BLOCK_Q < q_len:
        seq_len = tl.load(seq_lens_ptr + seq)
        rows = tl.arange(0, BLOCK_M)  # [M]: token-major, then the query heads of this KV head
        q_local = tile * BLOCK_Q + rows // GQA  # [M] the row's new token within the sequence
        head = kv_head * GQA + rows % GQA  # [M]
        row_ok = (rows < BLOCK_Q * GQA) & (q_local < q_len)  # [M]
        q_pos = seq_len - q_len + q_local  # [M] the position of the row's token
        dims = tl.arange(0, HEAD_PAD)  # [Dp]
        dim_ok = dims < HEAD_DIM
        q_offsets = (q_start + q_local)[:, None] * stride_qt + head[:, None] * stride_qh + dims[None, :]
        q = tl.load(q_ptr + q_offsets, mask=row_ok[:, None] & dim_ok[None, :], other=0.0)  # [M, Dp]
        row_max = tl.full([BLOCK_M], float("-inf"), tl.float32)  # [M]
        row_sum = tl.zeros([BLOCK_M], tl.float32)  # [M]
        acc = tl.zeros([BLOCK_M, HEAD_PAD], tl.float32)  # [M, Dp]
        tile_end = tl.minimum(seq_len - q_len + (tile + 1) * BLOCK_Q, seq_len)  # keys the tile can see
        slots = tl.arange(0, BLOCK_SIZE)  # [S]
        for j in range(0, tl.cdiv(tile_end, BLOCK_SIZE)):
            block = tl.load(block_table_ptr + seq * stride_table + j).to(tl.int64)
            kv_offsets = (
                block * stride_cache_block
                + slots[:, None] * stride_cache_slot
                + kv_head * stride_cache_head
                + dims[None, :]
            )  # [S, Dp]
            keys = tl.load(cache_ptr + kv_offsets, mask=dim_ok[None, :], other=0.0)  # [S, Dp]
            values = tl.load(cache_ptr + kv_offsets + stride_cache_kv, mask=dim_ok[None, :], other=0.0)
            visible = (j * BLOCK_SIZE + slots)[None, :] <= q_pos[:, None]  # [M, S] causal
            acc, row_max, row_sum = _online_softmax_step(
                q, keys, values, visible, scale, acc, row_max, row_sum, DOT_FP32
            )
        acc = acc / row_sum[:, None]
        out_offsets = (q_start + q_local)[:, None] * stride_ot + head[:, None] * stride_oh + dims[None, :]
        tl.store(
            out_ptr + out_offsets, acc.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & dim_ok[None, :]
        )


def tile_rows(gqa: int, max_query_len: int) -> tuple[int, int]:
    """(BLOCK_Q, BLOCK_M): tokens per program and its padded row count. Decode-only steps take one
    token per program; steps with multi-token rows take as many tokens as fill `PREFILL_ROWS` rows."""
    block_q = 1 if max_query_len == 1 else max(1, PREFILL_ROWS // gqa)
    return block_q, max(MIN_DOT_ROWS, triton.next_power_of_2(block_q * gqa))


def paged_attention(
    q: torch.Tensor,  # [T, H, D]
    kv_cache: torch.Tensor,  # [num_blocks, block_size, 2, KVH, D]
    batch: RaggedBatch,
    scale: float,
) -> torch.Tensor:  # [T, H, D]
    """Attention of every new token of the step over its sequence's cache (which already holds the
    step's keys and values), causal within the step."""
    _, num_heads, head_dim = q.shape
    _, block_size, _, num_kv_heads, _ = kv_cache.shape
    if q.stride(2) != 1 or kv_cache.stride(4) != 1 or not kv_cache.is_contiguous():
        raise ValueError("paged_attention needs q with unit-stride head dims and a contiguous cache")
    gqa = num_heads // num_kv_heads
    block_q, block_m = tile_rows(gqa, batch.max_query_len)
    out = torch.empty_like(q)  # [T, H, D]
    num_seqs = batch.seq_lens.shape[0]
    grid = (num_seqs, triton.cdiv(batch.max_query_len, block_q), num_kv_heads)
    _paged_attention_kernel[grid](
        q,
        out,
        kv_cache,
        batch.block_table,
        batch.seq_lens,
        batch.query_start,
        scale,
        q.stride(0),
        q.stride(1),
        out.stride(0),
        out.stride(1),
        kv_cache.stride(0),
        kv_cache.stride(1),
        kv_cache.stride(2),
        kv_cache.stride(3),
        batch.block_table.stride(0),
        GQA=gqa,
        HEAD_DIM=head_dim,
        HEAD_PAD=max(MIN_DOT_ROWS, triton.next_power_of_2(head_dim)),
        BLOCK_SIZE=block_size,
        BLOCK_Q=block_q,
        BLOCK_M=block_m,
        DOT_FP32=q.device.type == "cpu",  # CPU tensors: Triton's interpreter
    )
    return out
