"""Matrix products over GGUF blocks in Triton: the weights stay in the file's blocks on the device
(Q8_0, Q4_0, Q5_0, Q4_1, Q5_1, Q2_K, Q4_K, Q5_K, Q6_K, IQ4_XS) and each program dequantizes its
tile as it streams it in; no float copy of a matrix is ever made.

Every kind is read 256 input features at a time (a chunk: one K-quant super-block, or eight 32-wide
blocks) as two planes of 128 columns in the order of the block's bytes, not of the features: a
Q4_K byte holds feature 64j + l in its low nibble and 64j + 32 + l in its high one, so the low
nibbles of 128 consecutive bytes are one plane and the high nibbles the other. The weights are
then read with contiguous loads, and the activations, which are few, are gathered in the plane's
order instead (`_dequant` returns each plane's feature offsets). Each column's scale is loaded for
it (the loads of one sub-block's columns coincide, and the cache serves them), so no tile is
reshaped.

`quantized_linear(x, weight, parts, out_features)` multiplies x [M, K] by a matrix whose rows come
in parts of one kind each (a fused q|k|v or gate|up of Q4_K and Q6_K rows, as Q4_K_M files have): a
launch per part, each writing its columns of one output. Up to four rows (decode) take the
matrix-vector kernels: `block_gemv_q8` (int8 activations and `dp4a`) for Q4_K, Q5_K, Q6_K, Q8_0
and Q4_0 under half-precision activations, `block_gemv` (float products, exact for float32
activations) otherwise. More rows take `tl.dot` with the weights rounded to the activations' dtype
(float32 activations: exact float32 products).
`dequantize_rows` gives rows of a matrix in float (the embedding lookup of a tied table).

Runs on CUDA, and on CPU tensors in Triton's interpreter, where the tests check every kind against
gguf's reference dequantization.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from weft.cuda import block_gemv, block_gemv_q8
from weft.kernels import GGUF_BLOCKS, BlockPart

# each kind's KIND in the kernels
_CODES = {"q8_0": 0, "q4_0": 1, "q5_0": 2, "q4_k": 3, "q6_k": 4, "q4_1": 5, "q5_1": 6, "q5_k": 7, "q2_k": 8}
_CODES["iq4_xs"] = 9
# kind -> (its code in the kernels, input features per block, bytes per block)
KINDS = {kind: (code, *GGUF_BLOCKS[kind]) for kind, code in _CODES.items()}
CHUNK = 256  # input features per iteration
GEMV_ROWS = 4  # up to this many rows, the matrix-vector kernels; more, `tl.dot` (tensor cores)


@triton.jit
def _legacy(w_ptr, rows, chunk, num_blocks, KIND: tl.constexpr):
    """Q8_0, Q4_0, Q5_0, Q4_1, Q5_1: eight 32-wide blocks; plane columns c = 16 g + i of block g hold
    its features i (low plane) and 16 + i (high plane)."""
    cols = tl.arange(0, 128)
    group = cols // 16
    inner = cols % 16
    block = chunk * 8 + group  # [P]
    ok = block < num_blocks
    if KIND == 0:
        size = 34
    elif KIND == 1:
        size = 18
    elif KIND == 2:
        size = 22
    elif KIND == 5:
        size = 20
    else:
        size = 24
    base = rows[:, None] + (block * size)[None, :]  # [N, P] byte offsets of the columns' blocks
    mask = tl.broadcast_to(ok[None, :], base.shape)
    d = block_gemv.f16(w_ptr, base, mask)  # [N, P]: each column's block scale (the loads of a block coincide)
    if KIND == 0:
        lo = tl.load(w_ptr + base + 2 + inner[None, :], mask=mask, other=0).to(tl.int8, bitcast=True)
        hi = tl.load(w_ptr + base + 18 + inner[None, :], mask=mask, other=0).to(tl.int8, bitcast=True)
        w_lo, w_hi = d * lo.to(tl.float32), d * hi.to(tl.float32)
    elif KIND == 1:  # Q4_0: d * (q - 8)
        byte = tl.load(w_ptr + base + 2 + inner[None, :], mask=mask, other=0).to(tl.int32)
        w_lo = d * ((byte & 15) - 8).to(tl.float32)
        w_hi = d * ((byte >> 4) - 8).to(tl.float32)
    elif KIND == 5:  # Q4_1: d * q + m, m at byte 2
        byte = tl.load(w_ptr + base + 4 + inner[None, :], mask=mask, other=0).to(tl.int32)
        m = block_gemv.f16(w_ptr, base + 2, mask)
        w_lo = d * (byte & 15).to(tl.float32) + m
        w_hi = d * (byte >> 4).to(tl.float32) + m
    else:  # Q5_0 / Q5_1: the fifth bit of feature j is bit j of the little-endian uint32 qh
        high = 2
        if KIND == 6:
            high = 4
        byte = tl.load(w_ptr + base + high + 4 + inner[None, :], mask=mask, other=0).to(tl.int32)
        bits_lo = tl.load(w_ptr + base + high + (inner // 8)[None, :], mask=mask, other=0).to(tl.int32)
        bits_hi = tl.load(w_ptr + base + high + 2 + (inner // 8)[None, :], mask=mask, other=0).to(tl.int32)
        shift = (inner % 8)[None, :]
        q_lo = (byte & 15) | (((bits_lo >> shift) & 1) << 4)
        q_hi = (byte >> 4) | (((bits_hi >> shift) & 1) << 4)
        if KIND == 2:
            w_lo, w_hi = d * (q_lo - 16).to(tl.float32), d * (q_hi - 16).to(tl.float32)
        else:
            m = block_gemv.f16(w_ptr, base + 2, mask)
            w_lo, w_hi = d * q_lo.to(tl.float32) + m, d * q_hi.to(tl.float32) + m
    feature = group * 32 + inner
    return w_lo, w_hi, feature, feature + 16, ok


@triton.jit
def _q4_k(w_ptr, rows, chunk):
    """Q4_K: 144 bytes (d, dmin, 12 bytes of 6-bit scales and mins, 128 bytes of nibbles); byte
    32 j + l holds feature 64 j + l (low, sub-block 2 j) and 64 j + 32 + l (high, 2 j + 1)."""
    base = rows + chunk * 144  # [N]
    d = block_gemv.f16(w_ptr, base, rows >= 0)[:, None]  # [N, 1]
    dmin = block_gemv.f16(w_ptr, base + 2, rows >= 0)[:, None]
    cols = tl.arange(0, 128)
    nibbles = tl.load(w_ptr + base[:, None] + 16 + cols[None, :]).to(tl.int32)  # [N, P]
    sub = 2 * (cols // 32)  # [P] the low nibbles' sub-block
    lo = _q4_k_plane(w_ptr, base, nibbles & 15, sub, d, dmin)
    hi = _q4_k_plane(w_ptr, base, nibbles >> 4, sub + 1, d, dmin)
    feature = (cols // 32) * 64 + cols % 32
    return lo, hi, feature, feature + 32, cols >= 0


@triton.jit
def _q5_k(w_ptr, rows, chunk):
    """Q5_K: 176 bytes (d, dmin, Q4_K's 12 bytes of scales and mins, 32 bytes of fifth bits, Q4_K's
    128 bytes of nibbles); the fifth bit of feature 64 j + l is bit 2 j of byte l, of 64 j + 32 + l
    bit 2 j + 1."""
    base = rows + chunk * 176  # [N]
    d = block_gemv.f16(w_ptr, base, rows >= 0)[:, None]  # [N, 1]
    dmin = block_gemv.f16(w_ptr, base + 2, rows >= 0)[:, None]
    cols = tl.arange(0, 128)
    nibbles = tl.load(w_ptr + base[:, None] + 48 + cols[None, :]).to(tl.int32)  # [N, P]
    bits = tl.load(w_ptr + base[:, None] + 16 + (cols % 32)[None, :]).to(tl.int32)
    sub = 2 * (cols // 32)  # [P] the low nibbles' sub-block
    q_lo = (nibbles & 15) | (((bits >> sub[None, :]) & 1) << 4)
    q_hi = (nibbles >> 4) | (((bits >> (sub + 1)[None, :]) & 1) << 4)
    lo = _q4_k_plane(w_ptr, base, q_lo, sub, d, dmin)
    hi = _q4_k_plane(w_ptr, base, q_hi, sub + 1, d, dmin)
    feature = (cols // 32) * 64 + cols % 32
    return lo, hi, feature, feature + 32, cols >= 0


@triton.jit
def _q2_k(w_ptr, rows, chunk):
    """Q2_K: 84 bytes (16 bytes of 4-bit scales and mins, 64 bytes of 2-bit quants, d, dmin); bits
    2 j of byte b hold feature 128 (b // 32) + 32 j + b % 32, whose 16-feature group's scale and
    min are byte 8 (b // 32) + 2 j + (b % 32) // 16. The low plane holds j = 0, 1, the high 2, 3."""
    base = rows + chunk * 84  # [N]
    d = block_gemv.f16(w_ptr, base + 80, rows >= 0)[:, None]  # [N, 1]
    dmin = block_gemv.f16(w_ptr, base + 82, rows >= 0)[:, None]
    cols = tl.arange(0, 128)
    b, j = cols % 64, cols // 64
    byte = tl.load(w_ptr + base[:, None] + 16 + b[None, :]).to(tl.int32)  # [N, P]
    group = 8 * (b // 32) + 2 * j + (b % 32) // 16  # [P]
    lo = _q2_k_plane(w_ptr, base, (byte >> (2 * j)[None, :]) & 3, group, d, dmin)
    hi = _q2_k_plane(w_ptr, base, (byte >> (2 * j + 4)[None, :]) & 3, group + 4, d, dmin)
    feature = 128 * (b // 32) + 32 * j + b % 32
    return lo, hi, feature, feature + 64, cols >= 0


@triton.jit
def _iq4_xs(w_ptr, rows, chunk):
    """IQ4_XS: 136 bytes (d, 2 bytes of scales' high bits, 4 of their low 4 bits, 128 of 4-bit
    indices into IQ4's 16 levels); byte 16 g + j of the 128 holds feature 32 g + j (low nibble) and
    32 g + 16 + j (high) of sub-block g, whose 6-bit scale is scales_l[g // 2] >> 4 (g % 2) | the
    bits 2 g of scales_h << 4, less 32."""
    base = rows + chunk * 136  # [N]
    cols = tl.arange(0, 128)
    g = cols // 16
    byte = tl.load(w_ptr + base[:, None] + 8 + cols[None, :]).to(tl.int32)  # [N, P]
    dl = block_gemv.iq4_xs_scales(w_ptr, base, rows >= 0, g)  # [N, P]
    lo = dl * (block_gemv.iq4_level(byte & 15) - 128).to(tl.float32)
    hi = dl * (block_gemv.iq4_level(byte >> 4) - 128).to(tl.float32)
    feature = 32 * g + cols % 16
    return lo, hi, feature, feature + 16, cols >= 0


@triton.jit
def _q2_k_plane(w_ptr, base, q, group, d, dmin):
    """q [N, P] times its group's 4-bit scale, less its 4-bit min (byte `group` [P] of the 16)."""
    packed = tl.load(w_ptr + base[:, None] + group[None, :]).to(tl.int32)  # [N, P]
    return (d * (packed & 15).to(tl.float32)) * q.to(tl.float32) - dmin * (packed >> 4).to(tl.float32)


@triton.jit
def _q4_k_plane(w_ptr, base, q, sub, d, dmin):
    """One plane of Q4_K weights: q [N, P] times each column's sub-block (`sub` [P]) scale, less its
    min (`block_gemv.q4_k_scale_min`)."""
    scale, low = block_gemv.q4_k_scale_min(w_ptr + base[:, None] + 4, sub[None, :])  # [N, P] each
    return (d * scale) * q.to(tl.float32) - dmin * low


@triton.jit
def _q6_k(w_ptr, rows, chunk):
    """Q6_K: 210 bytes (128 of low nibbles, 64 of high bit pairs, 16 int8 scales, d); low-nibble
    byte 64 h + r holds feature 128 h + r (low) and 128 h + 64 + r (high), each with two bits of
    byte 128 + 32 h + r % 32 and a scale per 16 features."""
    base = rows + chunk * 210  # [N]
    d = block_gemv.f16(w_ptr, base + 208, rows >= 0)[:, None]  # [N, 1]
    cols = tl.arange(0, 128)
    half = cols // 64
    r = cols % 64
    low = tl.load(w_ptr + base[:, None] + cols[None, :]).to(tl.int32)  # [N, P]
    high = tl.load(w_ptr + base[:, None] + 128 + (32 * half + r % 32)[None, :]).to(tl.int32)
    shift = ((r // 32) * 2)[None, :]
    q_lo = ((low & 15) | (((high >> shift) & 3) << 4)) - 32
    q_hi = ((low >> 4) | (((high >> (shift + 4)) & 3) << 4)) - 32
    sub = (8 * half + r // 16)[None, :]  # [1, P] the low plane's scale; the high plane's is 4 on
    sc_lo = tl.load(w_ptr + base[:, None] + 192 + sub).to(tl.int8, bitcast=True).to(tl.float32)
    sc_hi = tl.load(w_ptr + base[:, None] + 196 + sub).to(tl.int8, bitcast=True).to(tl.float32)
    feature = 128 * half + r
    return (
        (d * sc_lo) * q_lo.to(tl.float32),
        (d * sc_hi) * q_hi.to(tl.float32),
        feature,
        feature + 64,
        cols >= 0,
    )


@triton.jit
def _dequant(w_ptr, rows, chunk, num_blocks, KIND: tl.constexpr):
    """Chunk `chunk` of the rows at byte offsets `rows` [N]: (low plane [N, P], high plane [N, P]
    float32, each plane's feature offsets within the chunk [P], which columns exist [P])."""
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
def _quantized_linear_kernel(
    x_ptr, w_ptr, out_ptr, num_rows, num_out, num_chunks, num_blocks, stride_x, row_bytes, stride_out,
    KIND: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, DOT_FP32: tl.constexpr,
):  # fmt: skip
    """out [M, N] = x [M, K] times the rows' blocks, transposed, by `tl.dot` over each chunk's two
    planes (the prompt rows; decode rows take `block_gemv`)."""
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)  # [N] output columns
    m = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)  # [M] rows of x
    m_ok = m < num_rows
    rows = tl.where(n < num_out, n, 0).to(tl.int64) * row_bytes  # [N] byte offsets of the weight rows
    x_rows = x_ptr + m.to(tl.int64)[:, None] * stride_x  # [M, 1]
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for chunk in range(0, num_chunks):
        lo, hi, f_lo, f_hi, ok = _dequant(w_ptr, rows, chunk, num_blocks, KIND)
        x_mask = m_ok[:, None] & ok[None, :]
        x_lo = tl.load(x_rows + (chunk * 256 + f_lo)[None, :], mask=x_mask, other=0.0)  # [M, P]
        x_hi = tl.load(x_rows + (chunk * 256 + f_hi)[None, :], mask=x_mask, other=0.0)
        if DOT_FP32:  # float32 activations (no TF32), or Triton's interpreter, which multiplies
            # half-precision operands wrongly
            acc += tl.dot(x_lo.to(tl.float32), tl.trans(lo), input_precision="ieee")
            acc += tl.dot(x_hi.to(tl.float32), tl.trans(hi), input_precision="ieee")
        else:
            acc += tl.dot(x_lo, tl.trans(lo.to(x_lo.dtype)))
            acc += tl.dot(x_hi, tl.trans(hi.to(x_hi.dtype)))
    out = out_ptr + m.to(tl.int64)[:, None] * stride_out + n[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=m_ok[:, None] & (n < num_out)[None, :])


@triton.jit
def _dequantize_kernel(
    w_ptr, ids_ptr, out_ptr, num_chunks, num_blocks, row_bytes, stride_out, dim,
    KIND: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    """Row ids[i] of the matrix into row i of out, in out's dtype (BLOCK_N is 1: one row a program)."""
    i = tl.program_id(0)
    row = tl.load(ids_ptr + i).to(tl.int64)
    rows = tl.zeros([BLOCK_N], tl.int64) + row * row_bytes
    out = out_ptr + i.to(tl.int64) * stride_out
    for chunk in range(0, num_chunks):
        lo, hi, f_lo, f_hi, ok = _dequant(w_ptr, rows, chunk, num_blocks, KIND)
        keep = ok & (chunk * 256 + f_lo < dim)
        tl.store(out + chunk * 256 + f_lo, tl.sum(lo, 0).to(out_ptr.dtype.element_ty), mask=keep)
        tl.store(out + chunk * 256 + f_hi, tl.sum(hi, 0).to(out_ptr.dtype.element_ty), mask=keep)


def tile_config(num_rows: int, interpreted: bool = False) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps) of the tensor-core tiles that multiply more than `GEMV_ROWS`
    rows. Triton's interpreter (CPU tensors) costs per program, not per element: wide tiles there."""
    return (16 if num_rows <= 16 else 32 if num_rows <= 32 else 64), 4096 if interpreted else 64, 4


def takes_int8_activations(kind: str, dtype: torch.dtype) -> bool:
    """Whether decode rows of `kind` meet it as int8 (`block_gemv_q8`, llama.cpp's and weft's CPU
    rounding): Q4_K, Q5_K, Q6_K, Q8_0 and Q4_0 under half-precision activations. float32
    activations keep exact float products (`block_gemv`). `WEFT_GEMV_ACTIVATIONS=float|int8`
    decides for every dtype."""
    if kind not in block_gemv_q8.Q8_PLANES:
        return False
    chosen = os.environ.get("WEFT_GEMV_ACTIVATIONS", "")
    if chosen not in ("", "float", "int8"):
        raise ValueError(f"WEFT_GEMV_ACTIVATIONS={chosen!r}: choose float or int8 (or leave it unset)")
    return chosen == "int8" if chosen else dtype != torch.float32


def quantized_linear(
    x: torch.Tensor,  # [M, K], unit stride along K
    weight: torch.Tensor,  # [bytes] uint8: every part's rows of blocks
    parts: tuple[BlockPart, ...],
    out_features: int,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:  # [M, out_features] in x's dtype
    num_rows = x.shape[0]
    out = x.new_empty(num_rows, out_features)
    if num_rows == 0:
        return out
    if x.stride(1) != 1:
        x = x.contiguous()
    block_m, block_n, warps = tile_config(num_rows, x.device.type == "cpu")
    for part in parts:
        if num_rows <= GEMV_ROWS:
            w = weight[part.byte_start : part.byte_start + part.rows * part.row_bytes]
            gemv = block_gemv_q8.gemv_q8 if takes_int8_activations(part.kind, x.dtype) else block_gemv.gemv
            gemv(x, w, part.kind, part.rows, part.row_bytes, out[:, part.out_start :])
            continue
        code, block, size = KINDS[part.kind]
        num_blocks = part.row_bytes // size
        w = weight[part.byte_start : part.byte_start + part.rows * part.row_bytes]
        grid = (triton.cdiv(part.rows, block_n), triton.cdiv(num_rows, block_m))
        _quantized_linear_kernel[grid](
            x, w, out[:, part.out_start :], num_rows, part.rows, triton.cdiv(num_blocks * block, CHUNK),
            num_blocks, x.stride(0), part.row_bytes, out.stride(0),
            KIND=code, BLOCK_M=block_m, BLOCK_N=block_n,
            DOT_FP32=x.device.type == "cpu" or x.dtype == torch.float32, num_warps=warps,
        )  # fmt: skip
    return out if bias is None else out.add_(bias)


def dequantize_rows(
    weight: torch.Tensor,  # [bytes] uint8
    parts: tuple[BlockPart, ...],
    ids: torch.Tensor,  # [T] int64, rows of the matrix (all in one part)
    dtype: torch.dtype,
) -> torch.Tensor:  # [T, in_features]
    """Rows of a matrix in blocks, dequantized (the embedding lookup of a tied, quantized table).
    The matrix is of one part (a token embedding is never fused)."""
    (part,) = parts
    code, block, size = KINDS[part.kind]
    num_blocks = part.row_bytes // size
    dim = num_blocks * block
    out = torch.empty(ids.shape[0], dim, dtype=dtype, device=weight.device)
    if ids.shape[0]:
        w = weight[part.byte_start : part.byte_start + part.rows * part.row_bytes]
        _dequantize_kernel[(ids.shape[0],)](
            w, ids, out, triton.cdiv(dim, CHUNK), num_blocks, part.row_bytes, out.stride(0), dim,
            KIND=code, BLOCK_N=1,
        )  # fmt: skip
    return out
