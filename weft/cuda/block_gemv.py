"""Decode products over GGUF blocks in Triton (up to four rows of activations): the weights stream
once, and each weight costs a few instructions.

At batch 1 a 4-bit weight arrives every 0.12 ps on an H200 (4.8 TB/s), so the kernel has about four
instructions a weight before the arithmetic, not the memory, sets its speed. The general tile of
`cuda/quant.py` spends about 10.6 on a Q4_K weight (a scale decoded for every weight); here a weight
costs about 6.5 (sm_90 SASS of the loop, `benchmarks/gemv_sass.py`); `block_gemv_q8`, with int8
activations, 3.7. This kernel serves float32 activations and the kinds that one lacks:

- Each chunk of 256 input features is two planes of G groups of W weights that share one scale
  (Q4_K and Q5_K: 4 x 32, their sub-blocks; Q6_K, Q2_K and the 32-wide kinds: 8 x 16), laid out as
  the block's bytes are (a Q4_K byte's low nibble is one plane, its high nibble the other). A
  group's scale and its offset (the K-quants' mins, Q6_K's -32, Q4_0's -8, Q4_1's m) are decoded
  once per group, not per weight.
- A weight's integer q becomes float32 without a conversion instruction: `q | 0x4B000000` read as
  float32 is 2**23 + q, and one fused multiply-add, (2**23 + q) * s - 2**23 * s, gives q * s with
  a single rounding (exactly the float32 product q * s). A high nibble is used in place, as 16 q,
  its scale divided by 16 (exact); a Q2_K pair at bits 2 j as 4^j q.
- The offset never touches a weight: it multiplies the group's sum of activations, once a chunk.
- Products add into a [BLOCK_N, G, W] float32 accumulator, summed once after the loop (no
  reduction across threads inside it); a program owns BLOCK_N output columns of one activation row,
  and the programs of one column tile's rows are adjacent, so rows 2-4 read the tile from L2. A
  matrix of few output rows shares each tile's chunks among programs (`split_k`).

Runs on CUDA, and on CPU tensors in Triton's interpreter (`FMA` off there: the interpreter's
multiply-add rounds twice, so it takes (2**23 + q - 2**23) * s, the same number), where
tests/test_triton_quant.py checks every kind against gguf's reference dequantization.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from weft.cuda import split_k
from weft.kernels import GGUF_BLOCKS

MAGIC = tl.constexpr(8388608.0)  # 2**23: the float32 whose bits are 0x4B000000
# IQ4's 16 levels (llama.cpp's kvalues_iq4nl) + 128, as the bytes of two int64s: level q is byte q % 8
# of IQ4_LEVELS[q // 8] (the second's top byte, 241, read as a signed int64)
IQ4_LEVELS = tl.constexpr(0x766A5D4F3F2D1801)
IQ4_LEVELS_HIGH = tl.constexpr(0xF1D9C5B5A6998D81 - (1 << 64))
# kind -> (its code in the kernel, groups a plane, weights a group)
PLANES = {"q8_0": (0, 8, 16), "q4_0": (1, 8, 16), "q5_0": (2, 8, 16), "q4_k": (3, 4, 32),
          "q6_k": (4, 8, 16), "q4_1": (5, 8, 16), "q5_1": (6, 8, 16), "q5_k": (7, 4, 32),
          "q2_k": (8, 8, 16), "iq4_xs": (9, 8, 16)}  # fmt: skip


@triton.jit
def f16(ptr, offsets, mask):
    """float16 values at byte `offsets` (even) of the uint8 `ptr`, widened to float32."""
    return tl.load((ptr + offsets).to(tl.pointer_type(tl.float16)), mask=mask, other=0.0).to(tl.float32)


@triton.jit
def _times(q, scale, FMA: tl.constexpr):
    """q * scale: q [N, G, W] small non-negative int32, scale [N, G, 1] float32."""
    f = (q | 0x4B000000).to(tl.float32, bitcast=True)  # 2**23 + q
    if FMA:
        return tl.fma(f, scale, -MAGIC * scale)
    return (f - MAGIC) * scale


@triton.jit
def _q4_k(w_ptr, rows, chunk):
    """Q4_K: byte 32 j + l of the 128 holds features 64 j + l (low nibble, sub-block 2 j) and
    64 j + 32 + l (high, 2 j + 1); 6-bit scales and mins of the 8 sub-blocks in 12 bytes."""
    j = tl.arange(0, 4)
    lane = 32 * j[:, None] + tl.arange(0, 32)[None, :]  # [4, 32]
    base = rows + chunk * 144  # [N]
    q = tl.load(w_ptr + base[:, None, None] + 16 + lane[None, :, :]).to(tl.int32)  # [N, 4, 32]
    s_lo, o_lo, s_hi, o_hi = sub_block_scales(w_ptr, base, rows >= 0)
    feature = 64 * j[:, None] + tl.arange(0, 32)[None, :]  # [4, 32]
    return q & 15, s_lo, o_lo, feature, q & 0xF0, s_hi * 0.0625, o_hi, feature + 32, j >= 0


@triton.jit
def _q5_k(w_ptr, rows, chunk):
    """Q5_K: Q4_K's layout with 32 bytes of fifth bits before the nibbles (which start at 48): the
    fifth bit of feature 64 j + l is bit 2 j of byte l, of 64 j + 32 + l bit 2 j + 1."""
    j = tl.arange(0, 4)
    lane = tl.arange(0, 32)
    base = rows + chunk * 176  # [N]
    q = tl.load(w_ptr + base[:, None, None] + 48 + (32 * j[:, None] + lane[None, :])[None, :, :]).to(tl.int32)
    bits = tl.load(w_ptr + base[:, None, None] + 16 + lane[None, None, :]).to(tl.int32)  # [N, 1, 32]
    bits = bits >> (2 * j)[None, :, None]  # [N, 4, 32]: bit 0 the low nibble's, bit 1 the high's
    s_lo, o_lo, s_hi, o_hi = sub_block_scales(w_ptr, base, rows >= 0)
    feature = 64 * j[:, None] + lane[None, :]  # [4, 32]
    return (
        (q & 15) | ((bits & 1) << 4), s_lo, o_lo, feature,
        (q & 0xF0) | ((bits & 2) << 7), s_hi * 0.0625, o_hi, feature + 32,
        j >= 0,
    )  # fmt: skip


@triton.jit
def sub_block_scales(w_ptr, base, ok):
    """Q4_K's and Q5_K's d * scale and -dmin * min of sub-blocks 2 j and 2 j + 1, j < 4 ([N, 4]
    each, the super-blocks at byte offsets `base` [N]; d, dmin, then the 12 bytes of scales)."""
    j = tl.arange(0, 4)
    d = f16(w_ptr, base, ok)[:, None]  # [N, 1]
    dmin = f16(w_ptr, base + 2, ok)[:, None]
    sc_lo, min_lo = q4_k_scale_min(w_ptr + base[:, None] + 4, 2 * j[None, :])  # [N, 4] each
    sc_hi, min_hi = q4_k_scale_min(w_ptr + base[:, None] + 4, 2 * j[None, :] + 1)
    return d * sc_lo, -dmin * min_lo, d * sc_hi, -dmin * min_hi


@triton.jit
def _q2_k(w_ptr, rows, chunk):
    """Q2_K: bits 2 j of byte b (64 bytes from 16) hold feature 128 (b // 32) + 32 j + b % 32, its
    16-feature group's 4-bit scale and min in byte 8 (b // 32) + 2 j + (b % 32) // 16. Group g of
    the low plane is j = g // 4 and bytes 16 (g % 4) + l; of the high plane j + 2. A weight is used
    in place (byte & 3 << 2 j: 4^j q), its scale divided by 4^j."""
    g = tl.arange(0, 8)
    j, quarter = g // 4, g % 4
    lane = tl.arange(0, 16)[None, :]
    base = rows + chunk * 84  # [N]
    byte = tl.load(w_ptr + base[:, None, None] + (16 + 16 * quarter[:, None] + lane)[None, :, :]).to(tl.int32)
    d = f16(w_ptr, base + 80, rows >= 0)[:, None]  # [N, 1]
    dmin = f16(w_ptr, base + 82, rows >= 0)[:, None]
    at = base[:, None] + (8 * (quarter // 2) + 2 * j + quarter % 2)[None, :]  # [N, 8]: the low plane's
    packed_lo = tl.load(w_ptr + at).to(tl.int32)
    packed_hi = tl.load(w_ptr + at + 4).to(tl.int32)
    step = tl.where(j == 0, 1.0, 0.25)[None, :]  # 1 / 4^j
    feature = 128 * (quarter // 2)[:, None] + 32 * j[:, None] + 16 * (quarter % 2)[:, None] + lane  # [8, 16]
    return (
        byte & (3 << (2 * j))[None, :, None], d * (packed_lo & 15).to(tl.float32) * step,
        -dmin * (packed_lo >> 4).to(tl.float32), feature,
        byte & (48 << (2 * j))[None, :, None], d * (packed_hi & 15).to(tl.float32) * step * 0.0625,
        -dmin * (packed_hi >> 4).to(tl.float32), feature + 64,
        g >= 0,
    )  # fmt: skip


@triton.jit
def iq4_level(q):
    """IQ4's level q (int32 0-15) + 128, as int32 1-241 (a table lookup in two shifts)."""
    shift = (8 * (q & 7)).to(tl.int64)
    table = tl.where(q < 8, IQ4_LEVELS, IQ4_LEVELS_HIGH)
    return ((table >> shift) & 255).to(tl.int32)


@triton.jit
def _iq4_xs(w_ptr, rows, chunk):
    """IQ4_XS (see `quant._iq4_xs`): group g a sub-block of 32, its bytes 8 + 16 g + l; a weight is
    its level + 128 (1-241, `iq4_level`), the group's offset -128 times its scale."""
    g = tl.arange(0, 8)
    lane = tl.arange(0, 16)[None, :]
    base = rows + chunk * 136  # [N]
    byte = tl.load(w_ptr + base[:, None, None] + (8 + 16 * g[:, None] + lane)[None, :, :]).to(tl.int32)
    dl = iq4_xs_scales(w_ptr, base, rows >= 0, g)  # [N, 8]
    feature = 32 * g[:, None] + lane  # [8, 16]
    return (
        iq4_level(byte & 15), dl, -128.0 * dl, feature,
        iq4_level(byte >> 4), dl, -128.0 * dl, feature + 16,
        g >= 0,
    )  # fmt: skip


@triton.jit
def iq4_xs_scales(w_ptr, base, ok, g):
    """d * (the 6-bit scale - 32) of sub-blocks g ([S], any of 0-7) of the IQ4_XS super-blocks at
    byte offsets `base` [N]: [N, S]. Sub-block g's scale: its 4 bits of scales_l[g // 2] (byte 4 on),
    and bits 2 g of the 16-bit scales_h (byte 2) above them."""
    d = f16(w_ptr, base, ok)[:, None]  # [N, 1]
    high = tl.load((w_ptr + base + 2).to(tl.pointer_type(tl.int16))).to(tl.int32)[:, None]  # [N, 1]
    low = tl.load(w_ptr + base[:, None] + 4 + (g // 2)[None, :]).to(tl.int32)  # [N, S]
    scale = ((low >> (4 * (g % 2))[None, :]) & 15) | (((high >> (2 * g)[None, :]) & 3) << 4)
    return d * (scale - 32).to(tl.float32)


@triton.jit
def q4_k_scale_min(scales, s):
    """The 6-bit scale and min of sub-blocks s ([1, S]) from the 12 bytes at `scales` ([N, 1]):
    bytes s and s + 4 (s < 4), or packed from bytes s + 4, s - 4 and s (s >= 4)."""
    first = s < 4
    a = tl.load(scales + s).to(tl.int32)
    b = tl.load(scales + s + 4).to(tl.int32)
    c = tl.load(scales + tl.where(first, s, s - 4)).to(tl.int32)
    scale = tl.where(first, a & 63, (b & 15) | ((c >> 6) << 4)).to(tl.float32)
    low = tl.where(first, b & 63, (b >> 4) | ((a >> 6) << 4)).to(tl.float32)
    return scale, low


@triton.jit
def _q6_k(w_ptr, rows, chunk):
    """Q6_K: 210 bytes (128 of low nibbles, 64 of high bit pairs, 16 int8 scales, d). Group
    g = 4 h + r of 16 (h: which 128 features, r: which 16 of their first 64): low-nibble byte
    16 g + l holds features 128 h + 16 r + l (low) and + 64 (high), their two high bits in byte
    128 + 32 h + 16 (r % 2) + l at bits 2 (r // 2) and 2 (r // 2) + 4."""
    g = tl.arange(0, 8)
    h, r = g // 4, g % 4
    lane = tl.arange(0, 16)[None, :]
    base = rows + chunk * 210  # [N]
    low_at = 16 * g[:, None] + lane  # [8, 16]
    low = tl.load(w_ptr + base[:, None, None] + low_at[None, :, :]).to(tl.int32)  # [N, 8, 16]
    high_at = 128 + 32 * h[:, None] + 16 * (r % 2)[:, None] + lane  # [8, 16]
    high = tl.load(w_ptr + base[:, None, None] + high_at[None, :, :]).to(tl.int32)
    high = high << (4 - 2 * (r // 2))[None, :, None]  # the pairs at bits 4-5 (low plane), 8-9 (high)
    d = f16(w_ptr, base + 208, rows >= 0)[:, None]  # [N, 1]
    at = base[:, None] + 192 + (8 * h + r)[None, :]  # [N, 8]: the low plane's scale; the high's is 4 on
    sc_lo = d * tl.load(w_ptr + at).to(tl.int8, bitcast=True).to(tl.float32)
    sc_hi = d * tl.load(w_ptr + at + 4).to(tl.int8, bitcast=True).to(tl.float32)
    feature = 128 * h[:, None] + 16 * r[:, None] + lane  # [8, 16]
    return (
        (low & 0x0F) | (high & 0x30), sc_lo, -32.0 * sc_lo, feature,
        (low & 0xF0) | (high & 0x300), sc_hi * 0.0625, -32.0 * sc_hi, feature + 64,
        g >= 0,
    )  # fmt: skip


@triton.jit
def _legacy(w_ptr, rows, chunk, num_blocks, KIND: tl.constexpr):
    """Q8_0, Q4_0, Q5_0, Q4_1, Q5_1: eight 32-wide blocks, group g the block chunk * 8 + g; its
    features l (low plane) and 16 + l (high), l < 16."""
    g = tl.arange(0, 8)
    lane = tl.arange(0, 16)[None, :]
    block = chunk * 8 + g
    ok = block < num_blocks  # [8]: a row's last chunk may hold fewer blocks
    if KIND == 0:  # bytes a block, and where its quants start
        size, qs = 34, 2
    elif KIND == 1:
        size, qs = 18, 2
    elif KIND == 2:
        size, qs = 22, 6
    elif KIND == 5:
        size, qs = 20, 4
    else:
        size, qs = 24, 8
    at = rows[:, None] + (block * size)[None, :]  # [N, 8] byte offsets of the blocks
    mask = ok[None, :] & (rows >= 0)[:, None]
    d = f16(w_ptr, at, mask)  # [N, 8]
    if KIND >= 5:  # Q4_1, Q5_1: + m
        m = f16(w_ptr, at + 2, mask)
    elif KIND == 0:  # the zero point: 128 (q + 128), 8, 16
        m = -128.0 * d
    elif KIND == 1:
        m = -8.0 * d
    else:
        m = -16.0 * d
    weights = at[:, :, None] + qs + lane[None, :, :]  # [N, 8, 16]
    mask3 = mask[:, :, None]
    if KIND == 0:  # int8: q + 128 is 0-255
        lo = tl.load(w_ptr + weights, mask=mask3, other=0).to(tl.int32) ^ 0x80
        hi = tl.load(w_ptr + weights + 16, mask=mask3, other=0).to(tl.int32) ^ 0x80
        scale_hi = d
    else:
        byte = tl.load(w_ptr + weights, mask=mask3, other=0).to(tl.int32)
        lo, hi = byte & 0x0F, byte & 0xF0
        if KIND == 2 or KIND == 6:  # the fifth bits: bit l of the little-endian uint32 before qs
            bits = at[:, :, None] + qs - 4 + lane[None, :, :] // 8  # [N, 8, 16]
            shift = lane[None, :, :] % 8
            lo |= ((tl.load(w_ptr + bits, mask=mask3, other=0).to(tl.int32) >> shift) & 1) << 4
            hi |= ((tl.load(w_ptr + bits + 2, mask=mask3, other=0).to(tl.int32) >> shift) & 1) << 8
        scale_hi = d * 0.0625
    feature = 32 * g[:, None] + lane  # [8, 16]
    return lo, d, m, feature, hi, scale_hi, m, feature + 16, ok


@triton.jit
def _planes(w_ptr, rows, chunk, num_blocks, KIND: tl.constexpr):
    """Chunk `chunk` of the rows at byte offsets `rows` [N], as two planes, each (q [N, G, W] int32
    non-negative, its groups' scale [N, G] and offset [N, G], the features [G, W] within the chunk),
    then which groups exist [G]: the weights are q * scale + offset."""
    if KIND == 3:
        return _q4_k(w_ptr, rows, chunk)
    elif KIND == 4:
        return _q6_k(w_ptr, rows, chunk)
    elif KIND == 7:
        return _q5_k(w_ptr, rows, chunk)
    elif KIND == 8:
        return _q2_k(w_ptr, rows, chunk)
    elif KIND == 9:
        return _iq4_xs(w_ptr, rows, chunk)
    else:
        return _legacy(w_ptr, rows, chunk, num_blocks, KIND)


@triton.jit
def _gemv_kernel(
    x_ptr, w_ptr, out_ptr, sums_ptr, counts_ptr, num_out, num_chunks, num_blocks, stride_x, row_bytes,
    stride_out, KIND: tl.constexpr, G: tl.constexpr, W: tl.constexpr, BLOCK_N: tl.constexpr,
    FMA: tl.constexpr, SPLIT: tl.constexpr,
):  # fmt: skip
    """out[m, n-tile] = x[m] times the tile's rows of blocks, transposed (m: program_id(0); with
    SPLIT > 1, program_id(2) takes its share of the chunks, `split_k`)."""
    m = tl.program_id(0).to(tl.int64)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)  # [N] output columns
    rows = tl.where(n < num_out, n, 0).to(tl.int64) * row_bytes  # [N] byte offsets of the rows
    x_row = x_ptr + m * stride_x
    acc = tl.zeros([BLOCK_N, G, W], tl.float32)
    offsets = tl.zeros([BLOCK_N, G], tl.float32)  # the groups' offsets times their activations' sums
    first, end = split_k.chunk_range(num_chunks, SPLIT)
    for chunk in range(first, end):
        q_lo, s_lo, o_lo, f_lo, q_hi, s_hi, o_hi, f_hi, ok = _planes(w_ptr, rows, chunk, num_blocks, KIND)
        x_lo = tl.load(x_row + chunk * 256 + f_lo, mask=ok[:, None], other=0.0).to(tl.float32)  # [G, W]
        x_hi = tl.load(x_row + chunk * 256 + f_hi, mask=ok[:, None], other=0.0).to(tl.float32)
        acc += _times(q_lo, s_lo[:, :, None], FMA) * x_lo[None, :, :]
        acc += _times(q_hi, s_hi[:, :, None], FMA) * x_hi[None, :, :]
        offsets += o_lo * tl.sum(x_lo, 1)[None, :] + o_hi * tl.sum(x_hi, 1)[None, :]
    total = tl.sum(tl.sum(acc, 2), 1) + tl.sum(offsets, 1)  # [N]
    split_k.finish(total, out_ptr, m, n, num_out, stride_out, sums_ptr, counts_ptr, SPLIT)


def gemv_tile(num_out: int, interpreted: bool = False) -> tuple[int, int]:
    """(BLOCK_N, num_warps): 8 output columns a warp (64 weights a thread a chunk, where the loop
    costs least a weight), and tiles narrow enough that a matrix of few rows still gives every
    multiprocessor several programs. Triton's interpreter costs per program: one wide tile."""
    if interpreted:
        return min(8192, triton.next_power_of_2(num_out)), 1
    block_n = 32 if num_out >= 16384 else 16 if num_out >= 8192 else 8
    return block_n, block_n // 8


@dataclass(frozen=True, slots=True)
class DecodePlan:
    """How a decode kernel over one part's blocks is launched (`decode_plan`)."""

    num_blocks: int  # blocks a row
    num_chunks: int  # chunks of 256 features a row
    block_n: int
    warps: int
    grid: tuple[int, int, int]  # (rows of x, column tiles, split)
    split: int
    sums: torch.Tensor  # split-K's workspace (x itself where the split is 1)
    counts: torch.Tensor
    interpreted: bool  # CPU tensors: Triton's interpreter


def decode_plan(
    x: torch.Tensor,
    kind: str,
    num_out: int,
    row_bytes: int,
    tile: Callable[[int, bool], tuple[int, int]],  # (num_out, interpreted) -> (BLOCK_N, num_warps)
    split: int | None,
) -> DecodePlan:
    block, size = GGUF_BLOCKS[kind]
    num_blocks = row_bytes // size
    num_chunks = triton.cdiv(num_blocks * block, 256)
    interpreted = x.device.type == "cpu"
    block_n, warps = tile(num_out, interpreted)
    grid, split, sums, counts = split_k.plan(x, num_out, block_n, num_chunks, split)
    return DecodePlan(num_blocks, num_chunks, block_n, warps, grid, split, sums, counts, interpreted)


def gemv(
    x: torch.Tensor,  # [M, K], M <= 4, unit stride along K
    rows: torch.Tensor,  # [num_out * row_bytes] uint8: one part's rows of blocks
    kind: str,
    num_out: int,
    row_bytes: int,
    out: torch.Tensor,  # [M, >= num_out] view: column 0 is the part's first output
    split: int | None = None,  # programs a column tile (None: `split_k.split_for`)
) -> None:
    """out[:, :num_out] = x times one part's rows of blocks of `kind`, transposed (float products)."""
    code, groups, width = PLANES[kind]
    plan = decode_plan(x, kind, num_out, row_bytes, gemv_tile, split)
    _gemv_kernel[plan.grid](
        x, rows, out, plan.sums, plan.counts, num_out, plan.num_chunks, plan.num_blocks, x.stride(0),
        row_bytes, out.stride(0), KIND=code, G=groups, W=width, BLOCK_N=plan.block_n,
        FMA=not plan.interpreted, SPLIT=plan.split, num_warps=plan.warps,
    )  # fmt: skip
