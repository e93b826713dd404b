"""Greedy tokens in one Triton launch: each row's first largest logit, or `invalid` where the row
holds a NaN or nothing above -inf (tensor operations: a maximum, two tests, an or and a fill, five
launches, each costing more host time at batch 1 than its kernel runs)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 4096  # logits an iteration
BIG = tl.constexpr(1 << 30)


@triton.jit
def _greedy_kernel(x_ptr, stride_x, vocab, out_ptr, invalid, BLOCK: tl.constexpr):
    r = tl.program_id(0)
    row = x_ptr + r.to(tl.int64) * stride_x
    best = float("-inf")
    best_id = 0
    nan = 0
    for start in range(0, vocab, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        x = tl.load(row + offs, mask=offs < vocab, other=float("-inf"))
        nan = tl.maximum(nan, tl.max((x != x).to(tl.int32), 0))
        clean = tl.where(x != x, float("-inf"), x)
        top = tl.max(clean, 0)
        first = tl.min(tl.where(clean == top, offs, BIG), 0)
        better = top > best  # strictly: an equal maximum later in the row keeps the first id
        best_id = tl.where(better, first, best_id)
        best = tl.where(better, top, best)
    bad = (nan > 0) | (best == float("-inf"))
    tl.store(out_ptr + r, tl.where(bad, invalid, best_id).to(tl.int64))


def greedy_tokens(x: torch.Tensor, invalid: int) -> torch.Tensor:  # [B] int64
    """x [B, V] float32 with unit stride along V."""
    out = torch.empty(x.shape[0], dtype=torch.int64, device=x.device)
    if x.shape[0]:
        _greedy_kernel[(x.shape[0],)](x, x.stride(0), x.shape[1], out, invalid, BLOCK=BLOCK)
    return out
