"""Paged attention in Triton: every row of a step (decode tokens, prompt chunks, forced tokens,
mixed) in one launch, reading keys and values in place through the block table.

No gathered copy of the cache, no dense mask, no repeated K/V for grouped-query attention: a program
owns one tile of one sequence's new tokens for one KV head, and its rows are those tokens times the
query heads that share the KV head (`BLOCK_Q` tokens x `GQA` heads, padded to a power of two of at
least 16 rows, the smallest `tl.dot`). It walks the sequence's cache blocks up to the tile's last
position with an online softmax (the flash-attention recurrence), masking keys after each row's own
position (causal within the step, full over the cached context; in a sliding-window layer from the
start of each row's window, `RaggedBatch.window`). Programs of tiles past a sequence's new tokens
return at once, so one grid serves ragged lengths.

Decode-only steps with few sequences split each sequence's context too (flash-decoding): a program
per sequence, KV head and split walks its share of the blocks and writes its partial output with
the log of its softmax sum, and a second launch merges a sequence's splits (`decode_splits`). At
batch 1 the plain grid is one program per KV head, most of the GPU idle while each walks the whole
context in turn.

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
MAX_SPLITS = 16  # splits of a decode row's context, at most
PROGRAMS_PER_SM = 2  # decode steps split contexts until about this many programs per multiprocessor


@triton.jit
def _online_softmax_step(q, keys, values, visible, scale, acc, row_max, row_sum, softcap,
                         DOT_FP32: tl.constexpr, HAS_SOFTCAP: tl.constexpr):  # fmt: skip
    """One cache block of the flash-attention recurrence: q [M, Dp], keys and values [S, Dp] in the
    cache's dtype, visible [M, S]; acc [M, Dp], row_max and row_sum [M] in float32; the scores
    soft-capped (softcap * tanh(score / softcap), Gemma 2) where HAS_SOFTCAP."""
    if DOT_FP32:  # Triton's interpreter multiplies half-precision operands wrongly
        q, keys, values = q.to(tl.float32), keys.to(tl.float32), values.to(tl.float32)
    scores = tl.dot(q, tl.trans(keys), input_precision="ieee") * scale  # [M, S]
    if HAS_SOFTCAP:  # tanh(x) = 1 - 2 / (exp(2x) + 1)
        scores = softcap * (1.0 - 2.0 / (tl.exp(2.0 * scores / softcap) + 1.0))
    scores = tl.where(visible, scores, float("-inf"))
    new_max = tl.maximum(row_max, tl.max(scores, 1))  # [M]
    # A row that has seen no key yet (a sliding window starts past this block) keeps max -inf:
    # its probabilities and its rescale are 0 against a finite stand-in.
    shift = tl.where(new_max == float("-inf"), 0.0, new_max)  # [M]
    probs = tl.exp(scores - shift[:, None])  # [M, S]
    alpha = tl.exp(row_max - shift)  # [M]
    row_sum = row_sum * alpha + tl.sum(probs, 1)
    probs = probs.to(values.dtype)  # P @ V in the cache's dtype
    acc = acc * alpha[:, None] + tl.dot(probs, values, input_precision="ieee")
    return acc, new_max, row_sum


@triton.jit
def _load_block(cache_ptr, table_entry, slots, dims, dim_ok, kv_head, stride_block, stride_slot, stride_kv,
                stride_head):  # fmt: skip
    """The keys and values [S, Dp] of one KV head in the cache block that `table_entry` names."""
    block = tl.load(table_entry).to(tl.int64)
    offsets = block * stride_block + slots[:, None] * stride_slot + kv_head * stride_head + dims[None, :]
    keys = tl.load(cache_ptr + offsets, mask=dim_ok[None, :], other=0.0)
    values = tl.load(cache_ptr + offsets + stride_kv, mask=dim_ok[None, :], other=0.0)
    return keys, values


@triton.jit
def _paged_attention_kernel(
    q_ptr, out_ptr, cache_ptr,  # [T, H, D], [T, H, D], [num_blocks, block_size, 2, KVH, D]
    block_table_ptr, seq_lens_ptr, query_start_ptr,  # [B, max_blocks], [B], [B + 1] int32
    sinks_ptr, scale, softcap, window, stride_qt, stride_qh, stride_ot, stride_oh,
    stride_cache_block, stride_cache_slot, stride_cache_kv, stride_cache_head, stride_table,
    GQA: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    BLOCK_Q: tl.constexpr, BLOCK_M: tl.constexpr, DOT_FP32: tl.constexpr, HAS_SINKS: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
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
        # a sliding window of `window` keys (0: none): the tile's first row sees from its window's start
        low = tl.where(window > 0, q_pos - window + 1, 0)  # [M] each row's first key
        tile_start = tl.where(window > 0, tl.maximum(seq_len - q_len + tile * BLOCK_Q - window + 1, 0), 0)
        slots = tl.arange(0, BLOCK_SIZE)  # [S]
        for j in range(tile_start // BLOCK_SIZE, tl.cdiv(tile_end, BLOCK_SIZE)):
            keys, values = _load_block(
                cache_ptr, block_table_ptr + seq * stride_table + j, slots, dims, dim_ok, kv_head,
                stride_cache_block, stride_cache_slot, stride_cache_kv, stride_cache_head,
            )  # fmt: skip
            key = (j * BLOCK_SIZE + slots)[None, :]  # [1, S]
            visible = (key <= q_pos[:, None]) & (key >= low[:, None])  # [M, S] causal, in the window
            acc, row_max, row_sum = _online_softmax_step(
                q, keys, values, visible, scale, acc, row_max, row_sum, softcap, DOT_FP32, HAS_SOFTCAP
            )
        if HAS_SINKS:  # each head's sink joins the softmax's sum, with no value
            row_sum += tl.exp(tl.load(sinks_ptr + head, mask=row_ok, other=0.0) - row_max)
        acc = acc / tl.where(row_sum == 0.0, 1.0, row_sum)[:, None]  # (0: a padding row, no keys)
        out_offsets = (q_start + q_local)[:, None] * stride_ot + head[:, None] * stride_oh + dims[None, :]
        tl.store(
            out_ptr + out_offsets, acc.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & dim_ok[None, :]
        )


@triton.jit
def _decode_split_kernel(
    q_ptr, part_ptr, lse_ptr, cache_ptr, block_table_ptr, seq_lens_ptr,  # [B, H, SPLITS, Dp], [B, H, SPLITS]
    scale, softcap, window, stride_qt, stride_qh, stride_cache_block, stride_cache_slot, stride_cache_kv,
    stride_cache_head, stride_table, GQA: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, BLOCK_M: tl.constexpr, SPLITS: tl.constexpr, DOT_FP32: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
):  # fmt: skip
    """One split of one decode row's context for one KV head: its share of the blocks, rounded up
    to whole blocks, with the online softmax; writes the split's normalised output and the log of
    its softmax sum (-inf for a split past the context)."""
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + seq)
    low = tl.where(window > 0, tl.maximum(seq_len - window, 0), 0)  # the first key (a sliding window's)
    base = low // BLOCK_SIZE * BLOCK_SIZE
    share = tl.cdiv(tl.cdiv(seq_len - base, SPLITS), BLOCK_SIZE) * BLOCK_SIZE  # tokens of each split
    start = base + split * share
    rows = tl.arange(0, BLOCK_M)  # [M]: the query heads of this KV head, padded
    head = kv_head * GQA + rows
    row_ok = rows < GQA
    dims = tl.arange(0, HEAD_PAD)  # [Dp]
    dim_ok = dims < HEAD_DIM
    out_base = (seq * GQA * tl.num_programs(1) + head) * SPLITS + split  # [M]: (seq, head, split)
    if start < seq_len:
        q_offsets = seq * stride_qt + head[:, None] * stride_qh + dims[None, :]
        q = tl.load(q_ptr + q_offsets, mask=row_ok[:, None] & dim_ok[None, :], other=0.0)  # [M, Dp]
        row_max = tl.full([BLOCK_M], float("-inf"), tl.float32)
        row_sum = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, HEAD_PAD], tl.float32)
        end = tl.minimum(start + share, seq_len)
        slots = tl.arange(0, BLOCK_SIZE)  # [S]
        for j in range(start // BLOCK_SIZE, tl.cdiv(end, BLOCK_SIZE)):
            keys, values = _load_block(
                cache_ptr, block_table_ptr + seq * stride_table + j, slots, dims, dim_ok, kv_head,
                stride_cache_block, stride_cache_slot, stride_cache_kv, stride_cache_head,
            )  # fmt: skip
            key = j * BLOCK_SIZE + slots  # [S]
            visible = tl.broadcast_to(((key < end) & (key >= low))[None, :], (BLOCK_M, BLOCK_SIZE))
            acc, row_max, row_sum = _online_softmax_step(
                q, keys, values, visible, scale, acc, row_max, row_sum, softcap, DOT_FP32, HAS_SOFTCAP
            )
        tl.store(part_ptr + out_base[:, None] * HEAD_PAD + dims[None, :], acc / row_sum[:, None],
                 mask=row_ok[:, None])  # fmt: skip
        tl.store(lse_ptr + out_base, row_max + tl.log(row_sum), mask=row_ok)
    else:
        tl.store(lse_ptr + out_base, tl.full([BLOCK_M], float("-inf"), tl.float32), mask=row_ok)


@triton.jit
def _merge_splits_kernel(
    part_ptr, lse_ptr, sinks_ptr, out_ptr, stride_ot, stride_oh,
    HEAD_DIM: tl.constexpr, HEAD_PAD: tl.constexpr, SPLITS: tl.constexpr, HAS_SINKS: tl.constexpr,
):  # fmt: skip
    """A decode row's output for one query head: its splits weighed by their softmax sums (and
    the head's sink in the sum, with no value, where it has one)."""
    seq = tl.program_id(0)
    head = tl.program_id(1)
    base = seq * tl.num_programs(1) + head
    splits = tl.arange(0, SPLITS)
    lse = tl.load(lse_ptr + base * SPLITS + splits)  # [SPLITS]; split 0 always holds keys
    top = tl.max(lse, 0)
    if HAS_SINKS:
        sink = tl.load(sinks_ptr + head)
        top = tl.maximum(top, sink)
    weight = tl.exp(lse - top)  # [SPLITS], 0 for empty splits
    total = tl.sum(weight, 0)
    if HAS_SINKS:
        total += tl.exp(sink - top)
    dims = tl.arange(0, HEAD_PAD)
    parts = tl.load(part_ptr + (base * SPLITS + splits)[:, None] * HEAD_PAD + dims[None, :],
                    mask=(weight > 0)[:, None], other=0.0)  # fmt: skip
    out = tl.sum(parts * weight[:, None], 0) / total  # [Dp]
    tl.store(out_ptr + seq * stride_ot + head * stride_oh + dims, out.to(out_ptr.dtype.element_ty),
             mask=dims < HEAD_DIM)  # fmt: skip


def decode_splits(num_seqs: int, num_kv_heads: int, device: torch.device) -> int:
    """Splits of each context for a decode-only step of `num_seqs` sequences: enough programs for
    about `PROGRAMS_PER_SM` per multiprocessor, at most `MAX_SPLITS`, a power of two (1: no split).
    Off CUDA (Triton's interpreter, whose cost is per program) as for a GPU of 2 multiprocessors."""
    sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 2
    wanted = -(-PROGRAMS_PER_SM * sms // (num_seqs * num_kv_heads))
    return min(MAX_SPLITS, 1 << max(0, wanted - 1).bit_length()) if wanted > 1 else 1


def split_decode_attention(
    q: torch.Tensor,  # [B, H, D], one query per sequence
    kv_cache: torch.Tensor,  # [num_blocks, block_size, 2, KVH, D]
    batch: RaggedBatch,
    scale: float,
    splits: int,
    sinks: torch.Tensor | None = None,  # [H] float32
    softcap: float = 0.0,
) -> torch.Tensor:  # [B, H, D]
    num_seqs, num_heads, head_dim = q.shape
    _, block_size, _, num_kv_heads, _ = kv_cache.shape
    gqa = num_heads // num_kv_heads
    head_pad = max(MIN_DOT_ROWS, triton.next_power_of_2(head_dim))
    part = torch.empty(num_seqs, num_heads, splits, head_pad, dtype=torch.float32, device=q.device)
    lse = torch.empty(num_seqs, num_heads, splits, dtype=torch.float32, device=q.device)
    _decode_split_kernel[(num_seqs, num_kv_heads, splits)](
        q, part, lse, kv_cache, batch.block_table, batch.seq_lens, scale, softcap, batch.window, q.stride(0),
        q.stride(1), kv_cache.stride(0), kv_cache.stride(1), kv_cache.stride(2), kv_cache.stride(3),
        batch.block_table.stride(0), GQA=gqa, HEAD_DIM=head_dim, HEAD_PAD=head_pad, BLOCK_SIZE=block_size,
        BLOCK_M=max(MIN_DOT_ROWS, triton.next_power_of_2(gqa)), SPLITS=splits,
        DOT_FP32=q.device.type == "cpu", HAS_SOFTCAP=softcap > 0,
    )  # fmt: skip
    out = torch.empty_like(q)
    _merge_splits_kernel[(num_seqs, num_heads)](
        part, lse, lse if sinks is None else sinks, out, out.stride(0), out.stride(1), HEAD_DIM=head_dim,
        HEAD_PAD=head_pad, SPLITS=splits, HAS_SINKS=sinks is not None,
    )  # fmt: skip
    return out


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
    sinks: torch.Tensor | None = None,  # [H] float32, each head's attention sink
    softcap: float = 0.0,  # scores -> softcap * tanh(score / softcap) (Gemma 2); 0: none
) -> torch.Tensor:  # [T, H, D]
    """Attention of every new token of the step over its sequence's cache (which already holds the
    step's keys and values), causal within the step."""
    _, num_heads, head_dim = q.shape
    _, block_size, _, num_kv_heads, _ = kv_cache.shape
    if q.stride(2) != 1 or kv_cache.stride(4) != 1 or not kv_cache.is_contiguous():
        raise ValueError("paged_attention needs q with unit-stride head dims and a contiguous cache")
    gqa = num_heads // num_kv_heads
    if batch.max_query_len == 1 and q.shape[0] == batch.seq_lens.shape[0]:
        splits = decode_splits(q.shape[0], num_kv_heads, q.device)
        if splits > 1:
            return split_decode_attention(q, kv_cache, batch, scale, splits, sinks, softcap)
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
        q if sinks is None else sinks,
        scale,
        softcap,
        batch.window,
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
        HAS_SINKS=sinks is not None,
        HAS_SOFTCAP=softcap > 0,
    )
    return out
