"""Decode products over Q4_K, Q5_K, Q6_K, Q8_0 and Q4_0 blocks with int8 activations, four
products an instruction.

What llama.cpp's CUDA matrix-vector kernels do, in Triton: the activations are rounded to int8 and
a weight's integer meets its activation's in `dp4a` (four byte products and their sum, one
instruction), so a weight costs about one instruction where `block_gemv`'s float products cost six.
The rounding is the one weft's CPU kernels and llama.cpp's x86 code use: for the K-quants
quantize_row_q8_K (per 256 features, q = rint(x * (127 / max |x|)), d = 1 / (127 / max |x|)), for
Q8_0 and Q4_0 quantize_row_q8_0 (per block of 32, the same q, d = float16(max |x| / 127)); a NaN
rounds to 0. So decode rows round their activations as they do on CPU.

A program owns BLOCK_N output columns of one activation row. For each chunk of 256 features it
rounds its activations itself (in registers, packed four to an int32; cheaper than a kernel of its
own a product, which at batch 1 would add a launch to every matrix) and then, for each plane (a
Q4_K byte's low and high nibbles; Q5_K's with their fifth bits, Q6_K's with their high bit pairs,
put together; a Q8_0 block's two halves), takes `dp4a` of four weights' bytes with four
activations'. A Q4_K high nibble is used in place (its byte & 0xF0, 16 q; the group's scale
divided by 16), so a word of eight Q4_K weights costs two logic operations and two `dp4a`. Each
group (the sub-blocks of 32 of Q4_K and Q5_K, Q6_K's 16, a 32-wide block) sums its products as
int32; its scale, its offset (the mins, Q6_K's -32, Q4_0's -8) times the group's sum of
activations, and the activations' scale make the float result, once a group.

Under Triton's interpreter (CPU tensors, the tests), `dp4a` and `rint` are written out in plain
integer and float operations (`COMPILED` off): the same numbers.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from weft.cuda import split_k
from weft.cuda.block_gemv import decode_plan, f16, sub_block_scales

HIGH_NIBBLES = tl.constexpr(-252645136)  # 0xF0F0F0F0 as int32
ROUND = tl.constexpr(12582912.0)  # 1.5 * 2**23: v + ROUND - ROUND is v rounded to nearest even
# kind -> (its code in the kernel, groups a plane, int32 words of four weights a group)
Q8_PLANES = {"q8_0": (0, 8, 4), "q4_0": (1, 8, 4), "q4_k": (3, 4, 8), "q6_k": (4, 8, 4), "q5_k": (7, 4, 8)}


@triton.jit
def _dp4a(a, b, COMPILED: tl.constexpr, SIGNED: tl.constexpr = False):
    """Elementwise sum of the four products of a's bytes (unsigned, or SIGNED) and b's signed
    bytes (int32)."""
    if COMPILED:
        if SIGNED:
            return tl.inline_asm_elementwise(
                "dp4a.s32.s32 $0, $1, $2, 0;", "=r,r,r", [a, b], dtype=tl.int32, is_pure=True, pack=1
            )
        return tl.inline_asm_elementwise(
            "dp4a.u32.s32 $0, $1, $2, 0;", "=r,r,r", [a, b], dtype=tl.int32, is_pure=True, pack=1
        )
    if SIGNED:
        total = (((a << 24) >> 24) * ((b << 24) >> 24)) + (((a << 16) >> 24) * ((b << 16) >> 24))
        return total + (((a << 8) >> 24) * ((b << 8) >> 24)) + ((a >> 24) * (b >> 24))
    total = ((a & 0xFF) * ((b << 24) >> 24)) + (((a >> 8) & 0xFF) * ((b << 16) >> 24))
    return total + (((a >> 16) & 0xFF) * ((b << 8) >> 24)) + (((a >> 24) & 0xFF) * (b >> 24))


@triton.jit
def _rint(v, COMPILED: tl.constexpr):
    if COMPILED:
        return libdevice.rint(v)
    return (v + ROUND) - ROUND  # |v| <= 127.5 here


@triton.jit
def _round_activations(x_row, f_lo, f_hi, ok, COMPILED: tl.constexpr, PER_BLOCK: tl.constexpr):
    """The chunk's activations at features f_lo and f_hi ([G, Q, 4] each; groups not `ok` [G] are
    past the row's end) rounded to int8: (words [G, Q] of four int8 each, per plane; each group's
    sum of its int8s [G], per plane; the scale d). As quantize_row_q8_K rounds them (the K-quants:
    one scale d = 1 / (127 / max |x|) for the 256), or, PER_BLOCK, as quantize_row_q8_0 (a group of
    the two planes a block of 32: d [G] = float16(max |x| / 127))."""
    x_lo = tl.load(x_row + f_lo, mask=ok[:, None, None], other=0.0).to(tl.float32)  # [G, Q, 4]
    x_hi = tl.load(x_row + f_hi, mask=ok[:, None, None], other=0.0).to(tl.float32)
    finite_lo = tl.where(x_lo == x_lo, tl.abs(x_lo), 0.0)  # NaN left out of the maximum
    finite_hi = tl.where(x_hi == x_hi, tl.abs(x_hi), 0.0)
    amax = tl.maximum(tl.max(tl.max(finite_lo, 2), 1), tl.max(tl.max(finite_hi, 2), 1))  # [G]
    if not PER_BLOCK:
        amax = tl.max(amax, 0)
    inv = tl.where(amax > 0, 127.0 / tl.where(amax > 0, amax, 1.0), 0.0)
    if PER_BLOCK:
        d = (amax / 127.0).to(tl.float16).to(tl.float32)
        scale = inv[:, None, None]
    else:
        d = tl.where(inv > 0, 1.0 / tl.where(inv > 0, inv, 1.0), 0.0)
        scale = inv
    q_lo = _rint(x_lo * scale, COMPILED)
    q_hi = _rint(x_hi * scale, COMPILED)
    q_lo = tl.where(tl.abs(q_lo) <= 127, q_lo, 0.0).to(tl.int32)  # a NaN or an infinity: 0
    q_hi = tl.where(tl.abs(q_hi) <= 127, q_hi, 0.0).to(tl.int32)
    shift = (8 * tl.arange(0, 4))[None, None, :]
    words_lo = tl.sum((q_lo & 0xFF) << shift, 2)  # disjoint bytes: the sum is their bits
    words_hi = tl.sum((q_hi & 0xFF) << shift, 2)
    return words_lo, tl.sum(tl.sum(q_lo, 2), 1), words_hi, tl.sum(tl.sum(q_hi, 2), 1), d


@triton.jit
def _legacy_words(w_ptr, rows, chunk, num_blocks, KIND: tl.constexpr):
    """Q8_0 (34 bytes: d, 32 int8) and Q4_0 (18 bytes: d, 16 bytes of nibbles, q - 8): group g the
    block chunk * 8 + g, its features 4 w + k (low plane) and 16 + 4 w + k (high). A block's bytes
    are 2-byte aligned only, so each word is read as two halves."""
    g = tl.arange(0, 8)
    w = tl.arange(0, 4)
    block = chunk * 8 + g
    ok = block < num_blocks  # [8]: a row's last chunk may hold fewer blocks
    size = 34 if KIND == 0 else 18
    at = rows[:, None] + (block * size)[None, :]  # [N, 8] byte offsets of the blocks
    mask = ok[None, :] & (rows >= 0)[:, None]
    d = f16(w_ptr, at, mask)  # [N, 8]
    halves = at[:, :, None] + 2 + 4 * w[None, None, :]  # [N, 8, 4]: each word's first byte
    feature = (32 * g[:, None, None] + 4 * w[None, :, None]) + tl.arange(0, 4)[None, None, :]  # [8, 4, 4]
    if KIND == 0:  # int8: the low plane's bytes 2-17, the high's 18-33
        lo = _word(w_ptr, halves, mask[:, :, None])
        hi = _word(w_ptr, halves + 16, mask[:, :, None])
        return lo, d, 0.0 * d, feature, hi, d, 0.0 * d, feature + 16, ok
    word = _word(w_ptr, halves, mask[:, :, None])
    return word & 0x0F0F0F0F, d, -8.0 * d, feature, (word >> 4) & 0x0F0F0F0F, d, -8.0 * d, feature + 16, ok


@triton.jit
def _word(w_ptr, at, mask):
    """The int32 of the four bytes at `at` (2-byte aligned), from two 16-bit loads."""
    low = tl.load((w_ptr + at).to(tl.pointer_type(tl.int16)), mask=mask, other=0).to(tl.int32)
    high = tl.load((w_ptr + at + 2).to(tl.pointer_type(tl.int16)), mask=mask, other=0).to(tl.int32)
    return (low & 0xFFFF) | (high << 16)


@triton.jit
def _q4_k_words(w_ptr, rows, chunk):
    """Q4_K: word 8 j + w of the 128 bytes holds, in its bytes' low nibbles, features 64 j + 4 w + k
    (sub-block 2 j) and in their high ones 64 j + 32 + 4 w + k (2 j + 1), k < 4."""
    base = rows + chunk * 144  # [N]
    at = base[:, None] + 16 + 4 * tl.arange(0, 32)[None, :]  # [N, 32]: contiguous, so vector loads
    words = tl.reshape(tl.load((w_ptr + at).to(tl.pointer_type(tl.int32))), (at.shape[0], 4, 8))
    s_lo, o_lo, s_hi, o_hi, feature = _sub_block_scales(w_ptr, base, rows >= 0)
    return words & 0x0F0F0F0F, s_lo, o_lo, feature, words & HIGH_NIBBLES, s_hi * 0.0625, o_hi, feature + 32


@triton.jit
def _q5_k_words(w_ptr, rows, chunk):
    """Q5_K: Q4_K's words of nibbles (from byte 48), each byte's fifth bit from the 32 bytes at 16:
    bit 2 j of byte l for the low nibble of group j's byte l, bit 2 j + 1 for its high nibble."""
    j = tl.arange(0, 4)
    w = tl.arange(0, 8)
    base = rows + chunk * 176  # [N]
    at = base[:, None, None] + 48 + (32 * j[:, None] + 4 * w[None, :])[None, :, :]  # [N, 4, 8]
    words = tl.load((w_ptr + at).to(tl.pointer_type(tl.int32)))
    bits = tl.load((w_ptr + base[:, None, None] + 16 + 4 * w[None, None, :]).to(tl.pointer_type(tl.int32)))
    bits = bits >> (2 * j)[None, :, None]  # [N, 4, 8]: bit 0 of each byte the low nibble's, 1 the high's
    s_lo, o_lo, s_hi, o_hi, feature = _sub_block_scales(w_ptr, base, rows >= 0)
    return (
        (words & 0x0F0F0F0F) | ((bits & 0x01010101) << 4), s_lo, o_lo, feature,
        ((words >> 4) & 0x0F0F0F0F) | ((bits & 0x02020202) << 3), s_hi, o_hi, feature + 32,
    )  # fmt: skip


@triton.jit
def _sub_block_scales(w_ptr, base, ok):
    """`block_gemv.sub_block_scales`, and the low nibbles' features [4, 8, 4] of the words."""
    s_lo, o_lo, s_hi, o_hi = sub_block_scales(w_ptr, base, ok)
    j = tl.arange(0, 4)
    feature = (64 * j[:, None, None] + 4 * tl.arange(0, 8)[None, :, None]) + tl.arange(0, 4)[None, None, :]
    return s_lo, o_lo, s_hi, o_hi, feature


@triton.jit
def _q6_k_words(w_ptr, rows, chunk):
    """Q6_K (see `block_gemv._q6_k`): group g = 4 h + r of 16 features, four words of its low-nibble
    bytes 16 g + 4 w + k and of their high-bit bytes 128 + 32 h + 16 (r % 2) + 4 w + k, the pairs
    at bits 2 (r // 2) (low plane) and 2 (r // 2) + 4 (high plane) of each byte."""
    g = tl.arange(0, 8)
    w = tl.arange(0, 4)
    h, r = g // 4, g % 4
    base = rows + chunk * 210  # [N]
    low_at = (16 * g[:, None] + 4 * w[None, :])[None, :, :]  # [1, 8, 4]
    high_at = (128 + 32 * h[:, None] + 16 * (r % 2)[:, None] + 4 * w[None, :])[None, :, :]
    low = tl.load((w_ptr + base[:, None, None] + low_at).to(tl.pointer_type(tl.int32)))  # [N, 8, 4]
    high = tl.load((w_ptr + base[:, None, None] + high_at).to(tl.pointer_type(tl.int32)))
    shift = (2 * (r // 2))[None, :, None]
    q_lo = (low & 0x0F0F0F0F) | ((high << (4 - shift)) & 0x30303030)  # bytes 0-63
    q_hi = ((low >> 4) & 0x0F0F0F0F) | ((high >> shift) & 0x30303030)
    d = f16(w_ptr, base + 208, rows >= 0)[:, None]  # [N, 1]
    at = base[:, None] + 192 + (8 * h + r)[None, :]  # [N, 8]: the low plane's scales; the high's 4 on
    sc_lo = d * tl.load(w_ptr + at).to(tl.int8, bitcast=True).to(tl.float32)
    sc_hi = d * tl.load(w_ptr + at + 4).to(tl.int8, bitcast=True).to(tl.float32)
    group_start = 128 * h + 16 * r  # [8]; features [8, 4, 4]
    feature = (group_start[:, None, None] + 4 * w[None, :, None]) + tl.arange(0, 4)[None, None, :]
    return q_lo, sc_lo, -32.0 * sc_lo, feature, q_hi, sc_hi, -32.0 * sc_hi, feature + 64


@triton.jit
def _k_quant_words(w_ptr, rows, chunk, KIND: tl.constexpr):
    """A chunk's weights as two planes of int32 words of four bytes [N, G, Q], each plane's group
    scales and offsets [N, G] and features [G, Q, 4]; then which groups exist [G] (a K-quant's
    rows are whole super-blocks: all)."""
    if KIND == 3:
        w_lo, s_lo, o_lo, f_lo, w_hi, s_hi, o_hi, f_hi = _q4_k_words(w_ptr, rows, chunk)
    elif KIND == 7:
        w_lo, s_lo, o_lo, f_lo, w_hi, s_hi, o_hi, f_hi = _q5_k_words(w_ptr, rows, chunk)
    else:
        w_lo, s_lo, o_lo, f_lo, w_hi, s_hi, o_hi, f_hi = _q6_k_words(w_ptr, rows, chunk)
    return w_lo, s_lo, o_lo, f_lo, w_hi, s_hi, o_hi, f_hi, tl.arange(0, f_lo.shape[0]) >= 0


@triton.jit
def _gemv_q8_kernel(
    x_ptr, w_ptr, out_ptr, sums_ptr, counts_ptr, num_out, num_chunks, num_blocks, stride_x, row_bytes,
    stride_out, KIND: tl.constexpr, G: tl.constexpr, Q: tl.constexpr, BLOCK_N: tl.constexpr,
    COMPILED: tl.constexpr, SPLIT: tl.constexpr,
):  # fmt: skip
    """out[m, n-tile] = x[m], rounded to int8 a chunk at a time, times the tile's rows of blocks
    (with SPLIT > 1, program_id(2) takes its share of the chunks, `split_k`)."""
    m = tl.program_id(0).to(tl.int64)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)  # [N] output columns
    rows = tl.where(n < num_out, n, 0).to(tl.int64) * row_bytes  # [N] byte offsets of the rows
    x_row = x_ptr + m * stride_x
    acc = tl.zeros([BLOCK_N, G, Q], tl.float32)  # each word's scaled products: no reduction in the loop
    offsets = tl.zeros([BLOCK_N, G], tl.float32)  # the groups' offsets times their activations' sums
    first, end = split_k.chunk_range(num_chunks, SPLIT)
    for chunk in range(first, end):
        if KIND <= 1:  # Q8_0, Q4_0: activations rounded a block of 32 at a time
            w_lo, s_lo, o_lo, f_lo, w_hi, s_hi, o_hi, f_hi, ok = _legacy_words(
                w_ptr, rows, chunk, num_blocks, KIND
            )
        else:
            w_lo, s_lo, o_lo, f_lo, w_hi, s_hi, o_hi, f_hi, ok = _k_quant_words(w_ptr, rows, chunk, KIND)
        x_lo, sum_lo, x_hi, sum_hi, d = _round_activations(
            x_row + chunk * 256, f_lo, f_hi, ok, COMPILED, KIND <= 1
        )
        dot_lo = _dp4a(w_lo, x_lo[None, :, :], COMPILED, KIND == 0).to(tl.float32)  # [N, G, Q]
        dot_hi = _dp4a(w_hi, x_hi[None, :, :], COMPILED, KIND == 0).to(tl.float32)
        acc += (d * s_lo)[:, :, None] * dot_lo  # two sums, so that each is one fused multiply-add
        acc += (d * s_hi)[:, :, None] * dot_hi
        offsets += d * (o_lo * sum_lo.to(tl.float32)[None, :] + o_hi * sum_hi.to(tl.float32)[None, :])
    total = tl.sum(tl.sum(acc, 2), 1) + tl.sum(offsets, 1)  # [N]
    split_k.finish(total, out_ptr, m, n, num_out, stride_out, sums_ptr, counts_ptr, SPLIT)


def gemv_q8_tile(num_out: int, interpreted: bool = False) -> tuple[int, int]:
    """(BLOCK_N, num_warps): one warp a program (the chunk's rounding then stays inside a warp), 16
    output columns; the interpreter costs per program: one wide tile."""
    if interpreted:
        return min(8192, triton.next_power_of_2(num_out)), 1
    return 16, 1


def gemv_q8(
    x: torch.Tensor,
    rows: torch.Tensor,
    kind: str,
    num_out: int,
    row_bytes: int,
    out: torch.Tensor,
    split: int | None = None,
) -> None:
    """out[:, :num_out] = x rounded to int8, times one part's rows of blocks of `kind` (a kind of
    Q8_PLANES), transposed; the arguments are `block_gemv.gemv`'s."""
    code, groups, words = Q8_PLANES[kind]
    plan = decode_plan(x, kind, num_out, row_bytes, gemv_q8_tile, split)
    _gemv_q8_kernel[plan.grid](
        x, rows, out, plan.sums, plan.counts, num_out, plan.num_chunks, plan.num_blocks, x.stride(0),
        row_bytes, out.stride(0), KIND=code, G=groups, Q=words, BLOCK_N=plan.block_n,
        COMPILED=not plan.interpreted, SPLIT=plan.split, num_warps=plan.warps,
    )  # fmt: skip
