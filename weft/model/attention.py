"""Attention over a paged KV cache, for a batch of sequences of different lengths.

Each layer's cache is one tensor `[num_blocks, block_size, 2, num_kv_heads, head_dim]` holding K and V
side by side, so that a step's keys and values (prompts, prompt chunks and single decode tokens, mixed)
are written with one `index_copy_` at their slots, and each sequence's blocks are read back with one
`index_select` (advanced indexing with a 2-D block table measured twice as slow on CPU). The metadata
is built once per step and shared by all layers.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass(frozen=True, slots=True)
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [T] int64, flat cache slot (block_id * block_size + offset) per token
    block_table: torch.Tensor  # [B, max_blocks] int64, padded with block 0
    query_scatter_idx: torch.Tensor | None  # [T] int64, token -> row in [B * max_q]; None if all q_len 1
    attn_mask: torch.Tensor | None  # [B, 1, max_q, kv_len] bool, True = attend; None if not needed
    max_query_len: int
    kv_len: int  # keys gathered per sequence (max context length in the batch)

    @property
    def num_seqs(self) -> int:
        return int(self.block_table.shape[0])


def build_attention_metadata(
    query_lens: list[int],
    context_lens: list[int],
    block_tables: list[list[int]],
    block_size: int,
    device: torch.device,
) -> tuple[AttentionMetadata, torch.Tensor]:
    """Metadata for one step, plus the positions of all tokens ([T] int64).

    `context_lens[i]` counts sequence i's tokens after this step; its new tokens are the last
    `query_lens[i]` of them.
    """
    num_seqs = len(query_lens)
    max_q, kv_len = max(query_lens), max(context_lens)
    q_lens = torch.tensor(query_lens, dtype=torch.int64)  # [B]
    ctx_lens = torch.tensor(context_lens, dtype=torch.int64)  # [B]
    seq_idx = torch.repeat_interleave(torch.arange(num_seqs), q_lens)  # [T]
    starts = torch.cumsum(q_lens, 0) - q_lens  # [B]
    offset_in_query = torch.arange(int(q_lens.sum())) - starts[seq_idx]  # [T]
    positions = (ctx_lens - q_lens)[seq_idx] + offset_in_query  # [T]

    max_blocks = max(len(t) for t in block_tables)
    table = torch.zeros(num_seqs, max_blocks, dtype=torch.int64)
    for i, blocks in enumerate(block_tables):
        table[i, : len(blocks)] = torch.tensor(blocks, dtype=torch.int64)
    slot_mapping = table[seq_idx, positions // block_size] * block_size + positions % block_size  # [T]

    scatter_idx, mask = None, None
    if max_q > 1:
        scatter_idx = seq_idx * max_q + offset_in_query
    if num_seqs > 1 or max_q > 1:
        q_pos = (ctx_lens - q_lens)[:, None] + torch.arange(max_q)[None, :]  # [B, max_q]
        k_pos = torch.arange(kv_len)  # [kv_len]
        mask = (k_pos[None, None, :] <= q_pos[:, :, None]) & (k_pos[None, None, :] < ctx_lens[:, None, None])
        mask = mask.unsqueeze(1)  # [B, 1, max_q, kv_len]
    meta = AttentionMetadata(
        slot_mapping=slot_mapping.to(device),
        block_table=table.to(device),
        query_scatter_idx=None if scatter_idx is None else scatter_idx.to(device),
        attn_mask=None if mask is None else mask.to(device),
        max_query_len=max_q,
        kv_len=kv_len,
    )
    return meta, positions.to(device)


def paged_attention(
    q: torch.Tensor,  # [T, H, D]
    kv: torch.Tensor,  # [T, 2, KVH, D], keys (rotated) and values of the step's tokens
    kv_cache: torch.Tensor,  # [num_blocks, block_size, 2, KVH, D]
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:  # [T, H * D]
    _, num_heads, head_dim = q.shape
    num_blocks, block_size, _, num_kv_heads, _ = kv_cache.shape
    kv_cache.view(num_blocks * block_size, 2, num_kv_heads, head_dim).index_copy_(0, meta.slot_mapping, kv)

    num_seqs, max_q = meta.num_seqs, meta.max_query_len
    gathered = kv_cache.index_select(0, meta.block_table.flatten())  # [B * max_blocks, bs, 2, KVH, D]
    gathered = gathered.view(num_seqs, -1, 2, num_kv_heads, head_dim)[:, : meta.kv_len]  # [B, L, 2, KVH, D]
    keys = gathered[:, :, 0].transpose(1, 2)  # [B, KVH, L, D]
    values = gathered[:, :, 1].transpose(1, 2)  # [B, KVH, L, D]
    if meta.query_scatter_idx is None:
        queries = q.view(num_seqs, 1, num_heads, head_dim)
    else:
        queries = q.new_zeros(num_seqs * max_q, num_heads, head_dim)
        queries.index_copy_(0, meta.query_scatter_idx, q)
        queries = queries.view(num_seqs, max_q, num_heads, head_dim)
    out = F.scaled_dot_product_attention(
        queries.transpose(1, 2),  # [B, H, max_q, D]
        keys,
        values,
        attn_mask=meta.attn_mask,
        scale=scale,
        enable_gqa=num_heads != num_kv_heads,
    )  # [B, H, max_q, D]
    out = out.transpose(1, 2).reshape(num_seqs * max_q, num_heads * head_dim)
    if meta.query_scatter_idx is not None:
        out = out.index_select(0, meta.query_scatter_idx)
    return out  # [T, H * D]
