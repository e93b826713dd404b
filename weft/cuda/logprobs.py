"""Logprobs of sampled tokens in Triton: the chosen token's logprob and rank and the top n, in three
launches where tensor operations take about 25 (at batch 1 each launch costs more host time than
its kernel runs, and top-5 logprobs cost 14% of a decode step on an H200).

The row's log-softmax is never written. Each row is cut into slices of SLICE logits, one program a
slice:

1. `_normalizer_parts`: each slice's maximum (NaN left out, and noted) and its sum of exp(x - max);
2. `_slice_parts`: each program combines the row's parts into the log-softmax's shift (the maximum;
   NaN where the row holds a NaN) and log-sum, or takes the row's `norm`; then over its slice
   computes lp = (x - shift) - log_sum (the arithmetic of weft's CPU kernel, `row_logprobs_one`),
   counts the lp above the chosen token's, and keeps its slice's n best by (lp, then id; NaN as
   -inf);
3. `_merge`: one program a row adds the counts into the rank and merges the slices' candidates.

The same numbers as `TorchKernels.row_logprobs` up to the rounding of the exponentials' sum.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

SLICE = 4096  # logits a program
BIG = tl.constexpr(1 << 29)  # an id after every real one (twice it: after every candidate)


@triton.jit
def _normalizer_parts(x_ptr, stride_x, vocab, maxes_ptr, sums_ptr, nans_ptr, S: tl.constexpr,
                      SLICE: tl.constexpr):  # fmt: skip
    r, s = tl.program_id(0), tl.program_id(1)
    offs = s * SLICE + tl.arange(0, SLICE)
    x = tl.load(x_ptr + r.to(tl.int64) * stride_x + offs, mask=offs < vocab, other=float("-inf"))
    nan = tl.max((x != x).to(tl.int32), 0)
    clean = tl.where(x != x, float("-inf"), x)
    top = tl.max(clean, 0)
    total = tl.sum(tl.where(clean == float("-inf"), 0.0, tl.exp(clean - top)), 0)
    tl.store(maxes_ptr + r * S + s, top)
    tl.store(sums_ptr + r * S + s, total)
    tl.store(nans_ptr + r * S + s, nan)


@triton.jit
def _shift_and_log_sum(r, maxes_ptr, sums_ptr, nans_ptr, norm_ptr, S: tl.constexpr, S_PAD: tl.constexpr,
                       HAS_NORM: tl.constexpr):  # fmt: skip
    """The row's log-softmax as lp = (x - shift) - log_sum, from its slices' parts (or its norm)."""
    parts = tl.arange(0, S_PAD)
    ok = parts < S
    maxes = tl.load(maxes_ptr + r * S + parts, mask=ok, other=float("-inf"))
    sums = tl.load(sums_ptr + r * S + parts, mask=ok, other=0.0)
    nan = tl.max(tl.load(nans_ptr + r * S + parts, mask=ok, other=0), 0)
    top = tl.max(maxes, 0)
    total = tl.sum(tl.where(ok, sums * tl.exp(maxes - top), 0.0), 0)  # an all -inf row: NaN, as on CPU
    shift = tl.where(nan > 0, float("nan"), top)
    log_sum = tl.log(total)
    if HAS_NORM:
        norm = tl.load(norm_ptr + r)
        given = norm == norm
        shift = tl.where(given, norm, shift)
        log_sum = tl.where(given, 0.0, log_sum)
    return shift, log_sum


@triton.jit
def _slice_parts(x_ptr, stride_x, vocab, ids_ptr, norm_ptr, maxes_ptr, sums_ptr, nans_ptr, counts_ptr,
                 cand_lp_ptr, cand_ids_ptr, num_top, S: tl.constexpr, S_PAD: tl.constexpr,
                 SLICE: tl.constexpr, HAS_NORM: tl.constexpr):  # fmt: skip
    r, s = tl.program_id(0), tl.program_id(1)
    shift, log_sum = _shift_and_log_sum(r, maxes_ptr, sums_ptr, nans_ptr, norm_ptr, S, S_PAD, HAS_NORM)
    row = x_ptr + r.to(tl.int64) * stride_x
    chosen = (tl.load(row + tl.load(ids_ptr + r)) - shift) - log_sum
    offs = s * SLICE + tl.arange(0, SLICE)
    inside = offs < vocab
    lp = (tl.load(row + offs, mask=inside, other=0.0) - shift) - log_sum
    lp = tl.where(inside, lp, float("-inf"))
    tl.store(counts_ptr + r * S + s, tl.sum((lp > chosen).to(tl.int32), 0))
    key = tl.where(lp != lp, float("-inf"), lp)  # a NaN ranked as -inf
    token = tl.where(inside, offs, BIG + offs)  # past the row: after every real -inf
    alive = offs >= 0
    out = (r * S + s) * num_top
    for i in range(num_top):
        best = tl.max(tl.where(alive, key, float("-inf")), 0)
        pick = tl.min(tl.where(alive & (key == best), token, 2 * BIG), 0)
        tl.store(cand_lp_ptr + out + i, best)
        tl.store(cand_ids_ptr + out + i, pick)
        alive = alive & (token != pick)


@triton.jit
def _merge(x_ptr, stride_x, ids_ptr, norm_ptr, maxes_ptr, sums_ptr, nans_ptr, counts_ptr, cand_lp_ptr,
           cand_ids_ptr, out_ids_ptr, out_lp_ptr, ranks_ptr, num_top, S: tl.constexpr, S_PAD: tl.constexpr,
           C_PAD: tl.constexpr, HAS_NORM: tl.constexpr):  # fmt: skip
    r = tl.program_id(0)
    shift, log_sum = _shift_and_log_sum(r, maxes_ptr, sums_ptr, nans_ptr, norm_ptr, S, S_PAD, HAS_NORM)
    row = x_ptr + r.to(tl.int64) * stride_x
    chosen_id = tl.load(ids_ptr + r)
    parts = tl.arange(0, S_PAD)
    counts = tl.load(counts_ptr + r * S + parts, mask=parts < S, other=0)
    tl.store(ranks_ptr + r, tl.sum(counts, 0).to(tl.int64) + 1)
    out = r * (num_top + 1)
    tl.store(out_ids_ptr + out, chosen_id)
    tl.store(out_lp_ptr + out, (tl.load(row + chosen_id) - shift) - log_sum)
    c = tl.arange(0, C_PAD)
    ok = c < S * num_top
    key = tl.load(cand_lp_ptr + r * S * num_top + c, mask=ok, other=float("-inf"))
    token = tl.load(cand_ids_ptr + r * S * num_top + c, mask=ok, other=2 * BIG)
    alive = ok
    for i in range(num_top):
        best = tl.max(tl.where(alive, key, float("-inf")), 0)
        pick = tl.min(tl.where(alive & (key == best), token, 2 * BIG), 0)
        alive = alive & (token != pick)
        tl.store(out_ids_ptr + out + 1 + i, pick.to(tl.int64))
        tl.store(out_lp_ptr + out + 1 + i, (tl.load(row + pick) - shift) - log_sum)  # a NaN stays NaN


def row_logprobs(
    x: torch.Tensor,  # [R, V] float32, unit stride along V
    ids: torch.Tensor,  # [R] int64
    num_top: int,
    norm: torch.Tensor | None = None,  # [R] float32: logprobs are x - norm; NaN: the row's own
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(ids [R, n+1], logprobs [R, n+1], ranks [R]) as `TorchKernels.row_logprobs`."""
    rows, vocab = x.shape
    out_ids = torch.empty(rows, num_top + 1, dtype=torch.int64, device=x.device)
    out_lp = torch.empty(rows, num_top + 1, dtype=torch.float32, device=x.device)
    ranks = torch.empty(rows, dtype=torch.int64, device=x.device)
    if rows == 0:
        return out_ids, out_lp, ranks
    slices = triton.cdiv(vocab, SLICE)
    parts = rows * slices
    floats = torch.empty(parts * (2 + num_top), dtype=torch.float32, device=x.device)
    ints = torch.empty(parts * (2 + num_top), dtype=torch.int32, device=x.device)
    maxes, sums, cand_lp = floats[:parts], floats[parts : 2 * parts], floats[2 * parts :]
    nans, counts, cand_ids = ints[:parts], ints[parts : 2 * parts], ints[2 * parts :]
    has_norm = norm is not None
    norm_arg = norm if norm is not None else maxes
    s_pad = triton.next_power_of_2(slices)
    _normalizer_parts[(rows, slices)](x, x.stride(0), vocab, maxes, sums, nans, S=slices, SLICE=SLICE)
    _slice_parts[(rows, slices)](
        x, x.stride(0), vocab, ids, norm_arg, maxes, sums, nans, counts, cand_lp, cand_ids, num_top,
        S=slices, S_PAD=s_pad, SLICE=SLICE, HAS_NORM=has_norm,
    )  # fmt: skip
    _merge[(rows,)](
        x, x.stride(0), ids, norm_arg, maxes, sums, nans, counts, cand_lp, cand_ids, out_ids, out_lp, ranks,
        num_top, S=slices, S_PAD=s_pad, C_PAD=triton.next_power_of_2(max(slices * num_top, 1)),
        HAS_NORM=has_norm,
    )  # fmt: skip
    return out_ids, out_lp, ranks
