"""Attention over a paged KV cache, for a batch of sequences of different lengths.

Each layer's cache is one tensor `[num_blocks, block_size, 2, num_kv_heads, head_dim]` holding K and V
side by side, so that a step's keys and values (prompts, prompt chunks and single decode tokens, mixed)
are written at their slots in one call (`write_kv_`: a copy per token on CPU), and each sequence's
blocks are read back with one `index_select` (advanced indexing with a 2-D block table measured
twice as slow on CPU). The metadata is built once per step and shared by all layers. Single-token
rows and multi-token rows of a step attend in separate calls, so decode rows are never padded to a
prompt chunk's length.

Decode rows (one query each) take the kernel set's `paged_decode_attention` when it has one (on CPU,
weft's native kernel, which reads each sequence's keys and values in place through its block table
instead of gathering them first). Rows with a few new tokens (fast-forwarded grammar tokens) then
join them token by token: token i of a row is a one-query row whose context ends at itself. Longer
rows (prompts, prompt chunks) take the kernel set's `paged_prefill_attention` where it has one (on
CPU, weft's native kernel: causal over each sequence's blocks read in place, no mask, no padding,
and no work on keys a query cannot see); elsewhere SDPA over the gathered blocks with a mask.

A kernel set that attends every row of a step in one call (`takes_ragged_batch`: Triton on CUDA)
gets the step as a `RaggedBatch` instead (block table, sequence lengths, query offsets), and no
groups are built.

`PagedAttention` is the backend: it owns the cache layout (`kv_cache_shape`), builds a step's
metadata and attends, with the kernel set chosen for the device at load.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

import numpy as np
import torch
import torch.nn.functional as F

from weft.arrays import Upload, padded, to_device
from weft.kernels import TORCH_KERNELS, RaggedBatch, TorchKernels
from weft.kv_format import cache_row_size, widened


@dataclass(frozen=True, slots=True)
class AttentionGroup:
    """Sequences attended together in one call: the single-token (decode) rows, or the multi-token
    rows (prompt chunks, forced tokens). Grouping keeps a decode row from being padded to the length
    of a prompt chunk that shares its step."""

    token_idx: torch.Tensor | None  # [Tg] int64, the group's tokens within the step; None = all of them
    block_table: torch.Tensor  # [Bg, max_blocks] int64, padded with block 0
    context_lens: torch.Tensor  # [Bg] int64, tokens of each sequence after this step
    query_scatter_idx: torch.Tensor | None  # [Tg] int64, token -> row in [Bg * max_q]; None if max_q == 1
    attn_mask: torch.Tensor | None  # [Bg, 1, max_q, kv_len] bool, True = attend; None if not needed
    max_query_len: int
    kv_len: int  # keys gathered per sequence (the group's longest context)
    is_causal: bool = False  # equal fresh prompts: plain causal attention, no mask, no padding
    # [Bg + 1] int64, where each sequence's tokens start among the group's: set when the kernel set
    # attends multi-token rows in place (`paged_prefill_attention`), which needs no mask
    query_start: torch.Tensor | None = None
    window: int = 0  # a sliding-window layer's keys per query, itself included (in the mask too); 0: none

    @property
    def num_seqs(self) -> int:
        return int(self.block_table.shape[0])


@dataclass(frozen=True, slots=True)
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [T] int64, flat cache slot (block_id * block_size + offset) per token
    groups: tuple[AttentionGroup, ...]  # one or two; none when `ragged` is set
    ragged: RaggedBatch | None = None  # the whole step for `ragged_paged_attention`
    # the same step for the model's sliding-window layers (groups whose masks and kernels keep to
    # the window, or the ragged batch with its window); None where the model has none
    sliding: AttentionMetadata | None = None

    def windowed(self, window: int) -> AttentionMetadata:
        """The metadata a layer attending over the last `window` keys uses (0: this one)."""
        if window == 0:
            return self
        if self.sliding is not None and self._window_of(self.sliding) == window:
            return self.sliding
        if self.ragged is not None:  # (a CUDA graph's metadata, built without it: the window is a number)
            return AttentionMetadata(self.slot_mapping, (), replace(self.ragged, window=window))
        raise ValueError(f"this step's attention metadata was built without the window {window}")

    @staticmethod
    def _window_of(meta: AttentionMetadata) -> int:
        return meta.ragged.window if meta.ragged is not None else meta.groups[0].window

    @property
    def decode_group(self) -> AttentionGroup | None:
        """The step's one group when every row attends as one query (the fused decoder stack's
        case), else None."""
        if len(self.groups) == 1 and self.groups[0].max_query_len == 1:
            return self.groups[0]
        return None


@dataclass(frozen=True, slots=True)
class _StepShape:
    """One step's sequences on the host (numpy: building small arrays there costs a fraction of
    building torch tensors op by op); every decision is taken on the lists."""

    q_list: list[int]  # [B] new tokens of each sequence
    ctx_list: list[int]  # [B] tokens of each sequence after this step
    q_lens: np.ndarray  # [B] int64
    ctx_lens: np.ndarray  # [B] int64
    seq_idx: np.ndarray  # [T] int64, the row of each token
    table: np.ndarray  # [B, max_blocks] int64, padded with block 0
    block_size: int
    prefill_in_place: bool = False  # multi-token rows attend through `paged_prefill_attention`
    decode_in_place: bool = False  # single-query rows attend through `paged_decode_attention`: no mask
    window: int = 0  # the keys each query sees, itself included (a sliding-window layer); 0: all


def build_attention_metadata(
    query_lens: list[int],
    context_lens: list[int],
    block_tables: list[list[int]] | np.ndarray,
    block_size: int,
    device: torch.device,
    max_tokenwise_query_len: int = 1,
    ragged: bool = False,
    prefill_in_place: bool = False,
    decode_in_place: bool = False,
    tokenwise_more: tuple[int, int] | None = None,
    tokenwise_most: int | None = None,
    tokenwise_within: int | None = None,
    tokenwise_rows: Sequence[int] = (),
    put: Upload | None = None,
    window: int = 0,
    window_tables: np.ndarray | None = None,
) -> tuple[AttentionMetadata, torch.Tensor]:
    """Metadata for one step, plus the positions of all tokens ([T] int64).

    `context_lens[i]` counts sequence i's tokens after this step; its new tokens are the last
    `query_lens[i]` of them. `block_tables` are lists of block ids, or already an array
    [B, max_blocks] padded with block 0 (the engine's persistent tables). Rows of up to
    `max_tokenwise_query_len` new tokens attend token by token, as single-query rows (the kernel
    set's choice), and with `tokenwise_more` = (tokens, context) so do rows of up to `tokens` whose
    context is at most `context`, and rows whose new tokens times their context is at most
    `tokenwise_within`, and with `tokenwise_most` only rows whose new tokens times their
    context is at most that; the rows `tokenwise_rows` always; with `prefill_in_place`, longer
    rows attend through the kernel set's `paged_prefill_attention`; with `decode_in_place`,
    single-query groups get no mask (the kernel set's `paged_decode_attention` reads their context
    lengths). With `ragged`, the step is one `RaggedBatch` instead of groups. With `window`, the
    metadata's `sliding` is the same step for layers that attend over the last `window` keys, in
    the blocks of `window_tables` ([B, max_blocks], the sliding layers' own pool) where given.
    Host arrays go to the device by `put` (default: `to_device`, once each); nothing is read back."""
    put = put or (lambda array: to_device(array, device))
    num_tokens = sum(query_lens)
    q_lens, ctx_lens = np.array(query_lens, dtype=np.int64), np.array(context_lens, dtype=np.int64)  # [B]
    table = block_tables if isinstance(block_tables, np.ndarray) else padded(block_tables, pad=0)
    seq_idx, positions = _token_positions(q_lens, ctx_lens, num_tokens)  # [T] each
    slots = put(_slots(table, seq_idx, positions, block_size))  # [T]
    if ragged:
        step = _ragged_step(table, q_lens, ctx_lens, max(query_lens), slots, put)
    else:
        shape = _StepShape(
            query_lens, context_lens, q_lens, ctx_lens, seq_idx, table, block_size, prefill_in_place,
            decode_in_place,
        )  # fmt: skip
        rules = (max_tokenwise_query_len, tokenwise_more, tokenwise_within, tokenwise_most)
        short = None  # decode only: every row is one query already
        if num_tokens > len(query_lens):
            short = _tokenwise_rows(q_lens, ctx_lens, *rules)
            short[list(tokenwise_rows)] = True
        step = _grouped_step(shape, short, slots, put)
    main = step(table, 0)
    if window > 0:  # the sliding layers' step, in their own pool where it has tables
        own = _slots(window_tables, seq_idx, positions, block_size) if window_tables is not None else None
        sliding = step(table if window_tables is None else window_tables, window)
        main = replace(main, sliding=sliding if own is None else replace(sliding, slot_mapping=put(own)))
    return main, put(positions)


def _ragged_step(
    table: np.ndarray, q_lens: np.ndarray, ctx_lens: np.ndarray, max_q: int, slots: torch.Tensor, put: Upload
) -> Callable[[np.ndarray, int], AttentionMetadata]:
    """The step as one `RaggedBatch` over the block tables given (`table`'s batch built once)."""
    batch = _ragged_batch(table, q_lens, ctx_lens, max_q, put)

    def step(tables: np.ndarray, window: int) -> AttentionMetadata:
        own = batch if tables is table else _ragged_batch(tables, q_lens, ctx_lens, max_q, put)
        return AttentionMetadata(slots, (), replace(own, window=window))

    return step


def _grouped_step(
    shape: _StepShape, short: np.ndarray | None, slots: torch.Tensor, put: Upload
) -> Callable[[np.ndarray, int], AttentionMetadata]:
    """The step as groups of rows (`_split_groups`) over the block tables given."""

    def step(tables: np.ndarray, window: int) -> AttentionMetadata:
        return AttentionMetadata(
            slots, _split_groups(replace(shape, table=tables, window=window), short, put)
        )

    return step


def _slots(table: np.ndarray, seq_idx: np.ndarray, positions: np.ndarray, block_size: int) -> np.ndarray:
    """The flat cache slot of each token (table: [B, max_blocks]; seq_idx, positions: [T])."""
    return table[seq_idx, positions // block_size] * block_size + positions % block_size  # [T]


def _token_positions(
    q_lens: np.ndarray, ctx_lens: np.ndarray, num_tokens: int
) -> tuple[np.ndarray, np.ndarray]:  # [T] int64 each
    """The row of each of the step's tokens and its position (q_lens, ctx_lens: [B] int64)."""
    num_seqs = len(q_lens)
    if num_tokens == num_seqs:  # decode only: one token per sequence
        return np.arange(num_seqs), ctx_lens - 1
    seq_idx = np.repeat(np.arange(num_seqs), q_lens)  # [T]
    starts = np.cumsum(q_lens) - q_lens  # [B]
    return seq_idx, (ctx_lens - q_lens)[seq_idx] + np.arange(num_tokens) - starts[seq_idx]


def _tokenwise_rows(
    q_lens: np.ndarray,
    ctx_lens: np.ndarray,
    most_tokens: int,
    more: tuple[int, int] | None,
    within: int | None,
    most: int | None,
) -> np.ndarray:  # [B] bool
    """The rows attended token by token (`build_attention_metadata`'s rules)."""
    short = q_lens <= most_tokens
    if more is not None:
        short |= (q_lens <= more[0]) & (ctx_lens <= more[1])
    if within is not None:
        short |= q_lens * ctx_lens <= within
    if most is not None:
        short &= (q_lens == 1) | (q_lens * ctx_lens <= most)
    return short


def _split_groups(shape: _StepShape, short: np.ndarray | None, put: Upload) -> tuple[AttentionGroup, ...]:
    """The groups of a step with multi-token rows: the `short` rows ([B] bool) token by token as
    single queries, the others as they are; one group where all rows are of one kind (or, with
    `short` None, a decode-only step's rows)."""
    if short is None:
        return (_group(shape, None, None, put),)
    short_rows = np.flatnonzero(short).tolist()
    if not short_rows:
        return (_group(shape, None, None, put),)
    if len(short_rows) == len(shape.q_list):
        return (_group(_tokenwise(shape, short_rows), None, None, put),)
    long_rows = np.flatnonzero(~short).tolist()
    short_tokens = short[shape.seq_idx]  # [T] bool
    return (
        _group(_tokenwise(shape, short_rows), None, np.nonzero(short_tokens)[0], put),
        _group(shape, long_rows, np.nonzero(~short_tokens)[0], put),
    )


def _ragged_batch(
    table: np.ndarray, q_lens: np.ndarray, ctx_lens: np.ndarray, max_query_len: int, put: Upload
) -> RaggedBatch:
    """table: [B, max_blocks]; q_lens, ctx_lens: [B] int64."""
    query_start = np.zeros(len(q_lens) + 1, dtype=np.int32)  # [B + 1]
    np.cumsum(q_lens, out=query_start[1:])
    return RaggedBatch(
        block_table=put(table.astype(np.int32)),
        seq_lens=put(ctx_lens.astype(np.int32)),
        query_start=put(query_start),
        max_query_len=max_query_len,
    )


def build_tree_metadata(
    parents: list[int],
    block_ids: list[int],
    block_size: int,
    device: torch.device,
    window: int = 0,
    window_block_ids: list[int] | None = None,
) -> tuple[AttentionMetadata, torch.Tensor]:
    """Metadata for a token tree computed in one pass (scoring options that share prefixes): node
    i ([N], parents before children, `parents[i] < i`, -1 for a root) is written at slot i of the
    blocks `block_ids`, sits at position depth(i), and attends to itself and its ancestors only
    (with `window`, the metadata's `sliding` keeps sliding-window layers to the ancestors less than
    `window` deep above it, in the blocks `window_block_ids` of their own pool where given).
    Returns the metadata and the positions ([N] int64)."""
    num_nodes = len(parents)
    parent = np.array(parents, dtype=np.int64)  # [N]
    depth = np.zeros(num_nodes, dtype=np.int64)  # [N]
    mask = np.eye(num_nodes, dtype=np.bool_)  # [N, N], True = attend
    for i in range(num_nodes):  # parents come first, so each row extends its parent's finished row
        if parent[i] >= 0:
            depth[i] = depth[parent[i]] + 1
            mask[i] |= mask[parent[i]]
    table = np.array([block_ids], dtype=np.int64)  # [1, num_blocks]
    slots, rows = np.arange(num_nodes), np.zeros(num_nodes, dtype=np.int64)  # [N] each: node i at slot i
    slot_mapping = to_device(_slots(table, rows, slots, block_size), device)  # [N]
    group = AttentionGroup(
        token_idx=None,
        block_table=to_device(table, device),
        context_lens=to_device(np.array([num_nodes], dtype=np.int64), device),
        query_scatter_idx=None,
        attn_mask=to_device(mask[None, None], device),  # [1, 1, N, N]
        max_query_len=num_nodes,
        kv_len=num_nodes,
    )
    sliding = None
    if window > 0:
        near = depth[:, None] - depth[None, :] < window  # [N, N]: within the window above node i
        windowed = replace(group, attn_mask=to_device((mask & near)[None, None], device), window=window)
        own_slots = slot_mapping
        if window_block_ids is not None:
            own = np.array([window_block_ids], dtype=np.int64)  # [1, num_blocks]
            own_slots = to_device(_slots(own, rows, slots, block_size), device)
            windowed = replace(windowed, block_table=to_device(own, device))
        sliding = AttentionMetadata(own_slots, (windowed,))
    return AttentionMetadata(slot_mapping, (group,), sliding=sliding), to_device(depth, device)


def _tokenwise(shape: _StepShape, rows: list[int]) -> _StepShape:
    """The tokens of the sequences `rows` as sequences of one query each: token i of a row sees the
    row's context up to and including itself, through the row's block table."""
    token_rows: list[int] = []
    token_ctx: list[int] = []
    for row in rows:
        q, ctx = shape.q_list[row], shape.ctx_list[row]
        token_rows += [row] * q
        token_ctx += range(ctx - q + 1, ctx + 1)
    num_tokens = len(token_rows)
    all_rows = num_tokens == len(shape.q_list) and rows == list(range(num_tokens))
    return _StepShape(
        q_list=[1] * num_tokens,
        ctx_list=token_ctx,
        q_lens=np.ones(num_tokens, dtype=np.int64),
        ctx_lens=shape.ctx_lens if all_rows else np.array(token_ctx, dtype=np.int64),
        seq_idx=np.arange(num_tokens),
        table=shape.table if all_rows else shape.table[np.array(token_rows, dtype=np.int64)],
        block_size=shape.block_size,
        decode_in_place=shape.decode_in_place,
        window=shape.window,
    )


def _group(
    shape: _StepShape, rows: list[int] | None, token_idx: np.ndarray | None, put: Upload
) -> AttentionGroup:
    """The attention metadata of the sequences `rows` (None: all of them, in order), whose tokens
    are `token_idx` ([Tg] int64; None: all of the step's)."""
    q_list = shape.q_list if rows is None else [shape.q_list[r] for r in rows]
    ctx_list = shape.ctx_list if rows is None else [shape.ctx_list[r] for r in rows]
    q_lens, ctx_lens, table = shape.q_lens, shape.ctx_lens, shape.table
    if rows is not None:
        index = np.array(rows, dtype=np.int64)
        q_lens, ctx_lens, table = q_lens[index], ctx_lens[index], table[index]
    max_q, kv_len, num_seqs = max(q_list), max(ctx_list), len(q_list)
    num_blocks = -(-kv_len // shape.block_size)
    window = shape.window
    if max_q > 1 and shape.prefill_in_place:
        return _in_place_group(token_idx, q_lens, ctx_lens, table[:, :num_blocks], put, window)
    is_causal = max_q > 1 and all(q == max_q for q in q_list) and ctx_list == q_list
    is_causal &= window == 0 or max_q <= window  # (every key then within each query's window)
    scatter_idx, mask = None, None
    if max_q > 1 and not is_causal:
        local_seq = np.repeat(np.arange(num_seqs), q_lens)  # [Tg]
        starts = np.cumsum(q_lens) - q_lens
        scatter_idx = local_seq * max_q + np.arange(sum(q_list)) - starts[local_seq]
    masked = num_seqs > 1 or max_q > 1 or 0 < window < kv_len
    if masked and not is_causal and not (max_q == 1 and shape.decode_in_place):
        mask = _mask(q_lens, ctx_lens, max_q, kv_len, window)
    return AttentionGroup(
        token_idx=None if token_idx is None else put(token_idx),
        block_table=put(table[:, :num_blocks]),
        context_lens=put(ctx_lens),
        query_scatter_idx=None if scatter_idx is None else put(scatter_idx),
        attn_mask=None if mask is None else put(mask),
        max_query_len=max_q,
        kv_len=kv_len,
        is_causal=is_causal,
        window=window,
    )


def _mask(
    q_lens: np.ndarray, ctx_lens: np.ndarray, max_q: int, kv_len: int, window: int
) -> np.ndarray:  # [Bg, 1, max_q, kv_len] bool, True = attend
    """Each query sees the keys up to its own position, and in a sliding-window layer only the
    last `window` of them (q_lens, ctx_lens: [Bg] int64)."""
    q_pos = (ctx_lens - q_lens)[:, None] + np.arange(max_q)[None, :]  # [Bg, max_q]
    k_pos = np.arange(kv_len)[None, None, :]  # [1, 1, kv_len]
    mask = (k_pos <= q_pos[:, :, None]) & (k_pos < ctx_lens[:, None, None])  # [Bg, max_q, kv_len]
    if window > 0:
        mask &= k_pos > q_pos[:, :, None] - window
    return mask[:, None]


def _in_place_group(
    token_idx: np.ndarray | None,
    q_lens: np.ndarray,  # [Bg] int64
    ctx_lens: np.ndarray,  # [Bg] int64
    table: np.ndarray,  # [Bg, num_blocks] int64
    put: Upload,
    window: int = 0,
) -> AttentionGroup:
    """A group of multi-token rows for `paged_prefill_attention`: each sequence's tokens are a run
    of the group's, and the kernel reads the cache in place (no mask, no padding)."""
    query_start = np.zeros(len(q_lens) + 1, dtype=np.int64)  # [Bg + 1]
    np.cumsum(q_lens, out=query_start[1:])
    return AttentionGroup(
        token_idx=None if token_idx is None else put(token_idx),
        block_table=put(table),
        context_lens=put(ctx_lens),
        query_scatter_idx=None,
        attn_mask=None,
        max_query_len=int(q_lens.max()),
        kv_len=int(ctx_lens.max()),
        query_start=put(query_start),
        window=window,
    )


def paged_attention(
    q: torch.Tensor,  # [T, H, D]
    kv: torch.Tensor | None,  # [T, 2, KVH, D], keys (rotated) and values of the step's tokens
    kv_cache: torch.Tensor,  # [num_blocks, block_size, 2, KVH, D]
    meta: AttentionMetadata,
    scale: float,
    kernels: TorchKernels = TORCH_KERNELS,
    bf16_dot: bool = False,
    sinks: torch.Tensor | None = None,  # [H] float32, each head's attention sink (gpt-oss)
    softcap: float = 0.0,  # scores -> softcap * tanh(score / softcap) (Gemma 2); 0: none
) -> torch.Tensor:  # [T, H * D]
    """Write the step's keys and values into the cache (None: already there, `rope_write_kv_`),
    then attend. `bf16_dot`: multi-token rows attending in place round their products' inputs to
    bfloat16 (as the linear layers' `bf16_dot`). `sinks`: a logit per head that joins each softmax's
    sum with no value (the share of attention that goes nowhere)."""
    num_tokens, num_heads, head_dim = q.shape
    if kv is not None:
        kernels.write_kv_(kv_cache, kv, meta.slot_mapping)
    if meta.ragged is not None:
        out = kernels.ragged_paged_attention(q, kv_cache, meta.ragged, scale, sinks, softcap)  # [T, H, D]
        return out.view(num_tokens, num_heads * head_dim)
    extra = (bf16_dot, sinks, softcap)
    if len(meta.groups) == 1:
        return _attend(q, kv_cache, meta.groups[0], scale, kernels, *extra)
    out = q.new_empty(num_tokens, num_heads * head_dim)
    for group in meta.groups:
        assert group.token_idx is not None
        out[group.token_idx] = _attend(q[group.token_idx], kv_cache, group, scale, kernels, *extra)
    return out


def _attend(
    q: torch.Tensor,  # [Tg, H, D]
    kv_cache: torch.Tensor,  # [num_blocks, block_size, 2, KVH, D]
    group: AttentionGroup,
    scale: float,
    kernels: TorchKernels,
    bf16_dot: bool = False,
    sinks: torch.Tensor | None = None,  # [H] float32
    softcap: float = 0.0,
) -> torch.Tensor:  # [Tg, H * D]
    _, num_heads, head_dim = q.shape
    num_kv_heads = kv_cache.shape[3]
    num_seqs, max_q = group.num_seqs, group.max_query_len
    if max_q == 1 and kernels.reads_cache_in_place(head_dim):  # decode rows: read the cache in place
        out = kernels.paged_decode_attention(
            q, kv_cache, group.block_table, group.context_lens, scale, group.window, sinks, softcap
        )  # [Bg, H, D]
        return out.view(num_seqs, num_heads * head_dim)
    if group.query_start is not None:  # multi-token rows, read in place too
        out = kernels.paged_prefill_attention(
            q, kv_cache, group.block_table, group.context_lens, group.query_start, scale, bf16_dot,
            group.window, sinks, softcap,
        )  # fmt: skip
        return out.view(-1, num_heads * head_dim)  # [Tg, H * D]
    gathered = kv_cache.index_select(0, group.block_table.flatten())  # [Bg * max_blocks, bs, 2, KVH, row]
    gathered = widened(gathered, q.dtype)  # [Bg * max_blocks, bs, 2, KVH, D] (a half or Q8_0 cache: widened)
    gathered = gathered.view(num_seqs, -1, 2, num_kv_heads, head_dim)[:, : group.kv_len]  # [Bg, L, 2, KVH, D]
    keys = gathered[:, :, 0].transpose(1, 2)  # [Bg, KVH, L, D]
    values = gathered[:, :, 1].transpose(1, 2)  # [Bg, KVH, L, D]
    if group.query_scatter_idx is None:  # one query per sequence, or equal unpadded ones
        queries = q.reshape(num_seqs, max_q, num_heads, head_dim)
    else:
        queries = q.new_zeros(num_seqs * max_q, num_heads, head_dim)
        queries.index_copy_(0, group.query_scatter_idx, q)
        queries = queries.view(num_seqs, max_q, num_heads, head_dim)
    if softcap > 0 or sinks is not None:
        out = _attention_in_torch(queries.transpose(1, 2), keys, values, group, scale, sinks, softcap)
    else:
        out = F.scaled_dot_product_attention(
            queries.transpose(1, 2),  # [Bg, H, max_q, D]
            keys,
            values,
            attn_mask=group.attn_mask,
            is_causal=group.is_causal,
            scale=scale,
            enable_gqa=num_heads != num_kv_heads,
        )  # [Bg, H, max_q, D]
    out = out.transpose(1, 2).reshape(num_seqs * max_q, num_heads * head_dim)
    if group.query_scatter_idx is not None:
        out = out.index_select(0, group.query_scatter_idx)
    return out  # [Tg, H * D]


def _attention_in_torch(
    queries: torch.Tensor,  # [Bg, H, max_q, D]
    keys: torch.Tensor,  # [Bg, KVH, L, D]
    values: torch.Tensor,  # [Bg, KVH, L, D]
    group: AttentionGroup,
    scale: float,
    sinks: torch.Tensor | None,  # [H] float32
    softcap: float,
) -> torch.Tensor:  # [Bg, H, max_q, D]
    """Attention with the steps SDPA has not: scores soft-capped before the mask (Gemma 2), each
    head's sink logit in the softmax's sum with no value (gpt-oss)."""
    num_seqs, heads, max_q, _ = queries.shape
    keys = keys.repeat_interleave(heads // keys.shape[1], dim=1)  # [Bg, H, L, D]
    values = values.repeat_interleave(heads // values.shape[1], dim=1)
    scores = queries @ keys.transpose(2, 3) * scale  # [Bg, H, max_q, L]
    if softcap > 0:
        scores = scores.div_(softcap).tanh_().mul_(softcap)
    scores = scores.masked_fill(~_allowed(group, max_q, keys.shape[2], queries.device), -torch.inf)
    if sinks is None:
        return torch.softmax(scores, dim=-1) @ values
    sink_column = sinks.to(scores.dtype).view(1, heads, 1, 1).expand(num_seqs, heads, max_q, 1)
    probs = torch.softmax(torch.cat([scores, sink_column], dim=-1), dim=-1)[..., :-1]  # (the sink's dropped)
    return probs @ values


def _allowed(group: AttentionGroup, max_q: int, length: int, device: torch.device) -> torch.Tensor:
    """Which keys each query sees ([Bg, 1, max_q, L] or [max_q, L] bool): the group's mask, or
    causal (equal fresh prompts) or all."""
    if group.attn_mask is not None:
        return group.attn_mask
    allowed = torch.ones(max_q, length, dtype=torch.bool, device=device)
    return allowed.tril(length - max_q) if group.is_causal else allowed


class PagedAttention:
    """The attention backend: the KV-cache layout, a step's metadata, and attention over it, with
    the kernel set chosen for the device at load."""

    def __init__(
        self,
        kernels: TorchKernels = TORCH_KERNELS,
        head_dim: int | None = None,
        kv_group: int | None = None,
        num_heads: int | None = None,
        window: int = 0,
    ) -> None:
        self.kernels = kernels
        self.window = window  # the model's sliding-window layers' keys per query; 0: it has none
        self.head_dim = head_dim  # None: unknown, no ragged batches
        # query heads per KV head (1: no GQA; None: unknown) and query heads, for which rows attend
        # token by token (`TorchKernels.tokenwise_without_gqa`, `tokenwise_wide_gqa`, ...)
        self.kv_group = kv_group
        self.num_heads = num_heads
        self.bf16_dot = False  # prefill attention's products in bfloat16 (set at load with the linears')

    @staticmethod
    def kv_cache_shape(
        num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype
    ) -> tuple[int, ...]:
        """One layer's cache: keys and values side by side, so a step writes them in one copy; a
        head's row in the cache's format (`weft/kv_format.py`: D elements, or Q8_0 blocks' bytes)."""
        return (num_blocks, block_size, 2, num_kv_heads, cache_row_size(head_dim, dtype))

    def build_metadata(
        self,
        query_lens: list[int],
        context_lens: list[int],
        block_tables: list[list[int]] | np.ndarray,
        block_size: int,
        device: torch.device,
        tokenwise_rows: Sequence[int] = (),
        put: Upload | None = None,
        window_tables: np.ndarray | None = None,
    ) -> tuple[AttentionMetadata, torch.Tensor]:
        """See `build_attention_metadata` (`tokenwise_rows`: rows of generated tokens)."""
        max_tokenwise = self.kernels.max_tokenwise_query_len
        ragged = self.head_dim is not None and self.kernels.takes_ragged_batch(self.head_dim, block_size)
        in_place = self.head_dim is not None and self.kernels.prefills_in_place(self.head_dim)
        decode_in_place = self.head_dim is not None and self.kernels.reads_cache_in_place(self.head_dim)
        more, most, within = self._tokenwise_rules() if decode_in_place else (None, None, None)
        return build_attention_metadata(
            query_lens, context_lens, block_tables, block_size, device, max_tokenwise, ragged, in_place,
            decode_in_place, more, most, within, tokenwise_rows, put, self.window, window_tables,
        )  # fmt: skip

    def _tokenwise_rules(self) -> tuple[tuple[int, int] | None, int | None, int | None]:
        """`build_attention_metadata`'s `tokenwise_more`, `tokenwise_most` and `tokenwise_within`
        for this model."""
        group, wide, kernels = self.kv_group, self.kernels.tokenwise_wide_gqa, self.kernels
        more = kernels.tokenwise_without_gqa if group == 1 else None
        most = wide[1] if wide is not None and group is not None and group >= wide[0] else None
        work, width = kernels.tokenwise_work_without_gqa, (self.num_heads or 0) * (self.head_dim or 0)
        within = work // width if group == 1 and work is not None and width > 0 else None
        return more, most, within

    def build_tree_metadata(
        self,
        parents: list[int],
        block_ids: list[int],
        block_size: int,
        device: torch.device,
        window_block_ids: list[int] | None = None,
    ) -> tuple[AttentionMetadata, torch.Tensor]:
        """See `build_tree_metadata`."""
        return build_tree_metadata(parents, block_ids, block_size, device, self.window, window_block_ids)

    def __call__(
        self,
        q: torch.Tensor,  # [T, H, D]
        kv: torch.Tensor | None,  # [T, 2, KVH, D]; None: the cache holds them (`rope_write_kv_`)
        kv_cache: torch.Tensor,  # [num_blocks, block_size, 2, KVH, D]
        meta: AttentionMetadata,
        scale: float,
        sinks: torch.Tensor | None = None,  # [H] float32, each head's attention sink (gpt-oss)
        softcap: float = 0.0,  # scores -> softcap * tanh(score / softcap) (Gemma 2)
    ) -> torch.Tensor:  # [T, H * D]
        return paged_attention(q, kv, kv_cache, meta, scale, self.kernels, self.bf16_dot, sinks, softcap)
