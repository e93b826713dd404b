"""Split-K for the decode kernels over GGUF blocks: several programs share one column tile's chunks.

A matrix of few output rows (2,048: an attention projection, the MLP's down projection of a 1B
model) gives a matrix-vector kernel of one-warp programs only 128-256 of them, one or two a
multiprocessor: too few loads in flight to stream the memory (about 30 KB a multiprocessor on an
H200). So its chunks are split among `split` programs a tile, each adding its partial sums into a
float32 workspace with atomics; the program that finishes a tile last (an atomic count per tile)
reads the sums, stores the output and leaves zeros behind. One launch, no memset: the
workspace and the counts are all zero between launches, which CUDA graphs replay as they are.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

MIN_WARPS_PER_SM = 8  # one-warp programs a multiprocessor, at least, where the chunks allow
_WORKSPACES: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}
_RETIRED: list[tuple[torch.Tensor, torch.Tensor]] = []  # outgrown ones, which a captured graph may hold


@triton.jit
def chunk_range(num_chunks, SPLIT: tl.constexpr):
    """The chunks [first, end) of this program's share (program_id(2) of SPLIT)."""
    if SPLIT == 1:
        return 0, num_chunks
    per = tl.cdiv(num_chunks, SPLIT)
    first = tl.program_id(2) * per
    return first, tl.minimum(first + per, num_chunks)


@triton.jit
def finish(total, out_ptr, m, n, num_out, stride_out, sums_ptr, counts_ptr, SPLIT: tl.constexpr):
    """Store this tile's `total` [N] (its columns n of output row m), or with SPLIT > 1 add it to
    the workspace and, in the tile's last program, store the whole sum and zero the workspace."""
    ok = n < num_out
    if SPLIT == 1:
        tl.store(out_ptr + m * stride_out + n, total.to(out_ptr.dtype.element_ty), mask=ok)
    else:
        sums = sums_ptr + m * num_out + n
        tl.atomic_add(sums, total, mask=ok)
        tile = m * tl.num_programs(1) + tl.program_id(1)
        if tl.atomic_add(counts_ptr + tile, 1) == SPLIT - 1:  # the others' sums are in (acq_rel)
            whole = tl.atomic_add(sums, tl.zeros_like(total), mask=ok)  # read where the atomics add
            tl.store(out_ptr + m * stride_out + n, whole.to(out_ptr.dtype.element_ty), mask=ok)
            tl.store(sums, tl.zeros_like(total), mask=ok)  # nothing else touches the tile's sums now
            tl.store(counts_ptr + tile, 0)


def split_for(programs: int, num_chunks: int, device: torch.device) -> int:
    """How many programs share a tile's chunks: a power of two that gives the GPU about
    MIN_WARPS_PER_SM one-warp programs a multiprocessor, each with at least two chunks."""
    if device.type != "cuda":
        return 1
    wanted = MIN_WARPS_PER_SM * _multiprocessors(device)
    split = 1
    while programs * split < wanted and num_chunks // (2 * split) >= 2:
        split *= 2
    return split


@functools.cache
def _multiprocessors(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def workspace(device: torch.device, rows: int, num_out: int, tiles: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(float32 sums for rows x num_out outputs, int32 counts for `tiles` tiles), all zeros; kept
    for the device and grown (never freed) when a product needs more."""
    sums, counts = _WORKSPACES.get(device, (None, None))
    if sums is None or counts is None or sums.numel() < rows * num_out or counts.numel() < tiles:
        if sums is not None and counts is not None:
            _RETIRED.append((sums, counts))
        size = max(rows * num_out, 1 << 16, 0 if sums is None else sums.numel())
        count = max(tiles, 1 << 12, 0 if counts is None else counts.numel())
        sums = torch.zeros(size, dtype=torch.float32, device=device)
        counts = torch.zeros(count, dtype=torch.int32, device=device)
        _WORKSPACES[device] = (sums, counts)
    return sums, counts


def plan(
    x: torch.Tensor, num_out: int, block_n: int, num_chunks: int, split: int | None
) -> tuple[tuple[int, int, int], int, torch.Tensor, torch.Tensor]:
    """(the launch grid (rows of x, column tiles, split), the split, the workspace's sums and
    counts: x itself twice where the split is 1, never read then)."""
    rows, tiles = x.shape[0], triton.cdiv(num_out, block_n)
    if split is None:
        split = split_for(rows * tiles, num_chunks, x.device)
    sums, counts = workspace(x.device, rows, num_out, rows * tiles) if split > 1 else (x, x)
    return (rows, tiles, split), split, sums, counts
