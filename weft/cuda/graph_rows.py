"""A replayed decode graph's inputs staged in one Triton launch: a step's rows copied into the first
rows of the graph's static buffers and the rest made padding rows (`TorchKernels.stage_decode_rows`
does it in five copies and three fills, a launch each, and each launch costs host time at batch 1
that a decode step on a GPU does not have)."""

from __future__ import annotations

import triton
import triton.language as tl

from weft.kernels import DecodeRows

BLOCK_W = 128  # block-table entries an iteration


@triton.jit
def _stage_kernel(
    ids_src, pos_src, slot_src, table_src, lens_src, ids_dst, pos_dst, slot_dst, table_dst, lens_dst,
    num_rows, width, stride_src, stride_dst, pad_slot, pad_block,
    HAS_TOKENS: tl.constexpr, BLOCK_W: tl.constexpr,
):  # fmt: skip
    r = tl.program_id(0)
    if r < num_rows:
        if HAS_TOKENS:
            tl.store(ids_dst + r, tl.load(ids_src + r).to(ids_dst.dtype.element_ty))
            tl.store(pos_dst + r, tl.load(pos_src + r).to(pos_dst.dtype.element_ty))
            tl.store(lens_dst + r, tl.load(lens_src + r).to(lens_dst.dtype.element_ty))
        tl.store(slot_dst + r, tl.load(slot_src + r).to(slot_dst.dtype.element_ty))
        for start in range(0, width, BLOCK_W):
            cols = start + tl.arange(0, BLOCK_W)
            entries = tl.load(table_src + r.to(tl.int64) * stride_src + cols, mask=cols < width)
            tl.store(table_dst + r.to(tl.int64) * stride_dst + cols, entries.to(table_dst.dtype.element_ty),
                     mask=cols < width)  # fmt: skip
    else:  # a padding row: one token into the scratch block's first slot, reading only it
        tl.store(slot_dst + r, tl.full([], pad_slot, slot_dst.dtype.element_ty))  # (either may be a constant)
        tl.store(table_dst + r.to(tl.int64) * stride_dst, tl.full([], pad_block, table_dst.dtype.element_ty))
        if HAS_TOKENS:
            tl.store(lens_dst + r, tl.full([], 1, lens_dst.dtype.element_ty))


def stage_decode_rows(
    static: DecodeRows, step: DecodeRows, size: int, pad_block: int, block_size: int
) -> None:
    """As `TorchKernels.stage_decode_rows`, in one launch."""
    num_rows, width = step.table.shape
    has_tokens = static.ids is not None
    tokens = (static.ids, static.positions, static.lengths, step.ids, step.positions, step.lengths)
    dummy = static.slots  # never read or written where HAS_TOKENS is off
    ids_dst, pos_dst, lens_dst, ids_src, pos_src, lens_src = (t if t is not None else dummy for t in tokens)
    _stage_kernel[(size,)](
        ids_src, pos_src, step.slots, step.table, lens_src, ids_dst, pos_dst, static.slots, static.table,
        lens_dst, num_rows, width, step.table.stride(0), static.table.stride(0), pad_block * block_size,
        pad_block, HAS_TOKENS=has_tokens, BLOCK_W=BLOCK_W,
    )  # fmt: skip
