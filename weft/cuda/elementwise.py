"""Fused row-wise kernels in Triton: one launch each where plain torch takes several.

- `rms_norm`: RMSNorm in float32 whatever the input dtype, times the weight (torch: 4-6 kernels);
- `add_rms_norm_`: the residual add and the next RMSNorm in one pass (x += delta; returns the norm);
- `silu_mul`: SiLU(gate) * up from the fused gate|up projection (torch: 3 kernels and a temporary);
- `rope_`: the rotary embedding of q and k in place, looking each token's position up in the
  [P, D/2] cos/sin tables itself (torch: a gather of the tables, then 5 kernels);
- `rope_write_kv_`: the same rotation of a fused q|k|v row's q and k heads, and k and v written into
  the paged cache at the token's slot, in one launch (torch: the rotation, then a scatter).

Each program owns one row (one token, or one token's head for `rope_`). Runs on CUDA, and on CPU
tensors in Triton's interpreter (`TRITON_INTERPRET=1`), where CI tests it against `TorchKernels`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rms_norm_kernel(x_ptr, delta_ptr, w_ptr, out_ptr, stride_x, stride_delta, stride_out, dim, eps,
                     HAS_DELTA: tl.constexpr, BLOCK: tl.constexpr):  # fmt: skip
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    ok = cols < dim
    x = tl.load(x_ptr + row * stride_x + cols, mask=ok, other=0.0).to(tl.float32)  # [BLOCK]
    if HAS_DELTA:
        x += tl.load(delta_ptr + row * stride_delta + cols, mask=ok, other=0.0).to(tl.float32)
        tl.store(x_ptr + row * stride_x + cols, x.to(x_ptr.dtype.element_ty), mask=ok)
        x = x.to(x_ptr.dtype.element_ty).to(tl.float32)  # normalise the stored sum, as torch would
    inv_rms = 1.0 / tl.sqrt(tl.sum(x * x, 0) / dim + eps)
    normed = (x * inv_rms).to(out_ptr.dtype.element_ty).to(tl.float32)  # rounded as torch's is
    w = tl.load(w_ptr + cols, mask=ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_out + cols, (normed * w).to(out_ptr.dtype.element_ty), mask=ok)


@triton.jit
def _silu_mul_kernel(gate_up_ptr, out_ptr, stride_in, stride_out, inter, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < inter
    gate = tl.load(gate_up_ptr + row * stride_in + cols, mask=ok, other=0.0).to(tl.float32)
    up = tl.load(gate_up_ptr + row * stride_in + inter + cols, mask=ok, other=0.0).to(tl.float32)
    silu = (gate / (1.0 + tl.exp(-gate))).to(out_ptr.dtype.element_ty).to(tl.float32)
    tl.store(out_ptr + row * stride_out + cols, (silu * up).to(out_ptr.dtype.element_ty), mask=ok)


@triton.jit
def _rotate(base, cos, sin, cols, ok, half, dtype):
    """The rotate-half rotation of the head at `base`, in float32, rounded to `dtype`: (first half,
    second half)."""
    x1 = tl.load(base + cols, mask=ok, other=0.0).to(tl.float32)
    x2 = tl.load(base + half + cols, mask=ok, other=0.0).to(tl.float32)
    return (x1 * cos - x2 * sin).to(dtype), (x2 * cos + x1 * sin).to(dtype)


@triton.jit
def _rope_kernel(x_ptr, pos_ptr, cos_ptr, sin_ptr, stride_xt, stride_xh, stride_table, half,
                 BLOCK: tl.constexpr):  # fmt: skip
    token = tl.program_id(0)
    head = tl.program_id(1)
    cols = tl.arange(0, BLOCK)
    ok = cols < half
    pos = tl.load(pos_ptr + token)
    cos = tl.load(cos_ptr + pos * stride_table + cols, mask=ok, other=0.0)  # [BLOCK] float32
    sin = tl.load(sin_ptr + pos * stride_table + cols, mask=ok, other=0.0)
    base = x_ptr + token * stride_xt + head * stride_xh
    dtype = x_ptr.dtype.element_ty
    cos, sin = cos.to(dtype).to(tl.float32), sin.to(dtype).to(tl.float32)  # the tables in x's dtype
    first, second = _rotate(base, cos, sin, cols, ok, half, dtype)
    tl.store(base + cols, first, mask=ok)
    tl.store(base + half + cols, second, mask=ok)


@triton.jit
def _rope_write_kv_kernel(qkv_ptr, pos_ptr, slot_ptr, cos_ptr, sin_ptr, cache_ptr, stride_t, stride_h,
                          stride_table, stride_slot, stride_kv, stride_head, num_heads, num_kv, half,
                          BLOCK: tl.constexpr, HEADS: tl.constexpr, KV_HEADS: tl.constexpr):  # fmt: skip
    """Program `token`: its q and k heads rotated in place, and its k and v heads written into the
    cache at its slot (one tile of every head: on a GPU a token's heads are a few thousand
    elements; in Triton's interpreter, whose cost is per program, fewer programs)."""
    token = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    ok = cols < half
    pos = tl.load(pos_ptr + token)
    dtype = qkv_ptr.dtype.element_ty
    cos = tl.load(cos_ptr + pos * stride_table + cols, mask=ok, other=0.0).to(dtype).to(tl.float32)
    sin = tl.load(sin_ptr + pos * stride_table + cols, mask=ok, other=0.0).to(dtype).to(tl.float32)
    heads = tl.arange(0, HEADS)  # [R]: the q heads, then the k heads
    mask = (heads < num_heads + num_kv)[:, None] & ok[None, :]  # [R, BLOCK]
    base = qkv_ptr + token * stride_t + heads[:, None] * stride_h + cols[None, :]
    x1 = tl.load(base, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(base + half, mask=mask, other=0.0).to(tl.float32)
    first = (x1 * cos[None, :] - x2 * sin[None, :]).to(dtype)
    second = (x2 * cos[None, :] + x1 * sin[None, :]).to(dtype)
    tl.store(base, first, mask=mask)
    tl.store(base + half, second, mask=mask)
    slot_base = cache_ptr + tl.load(slot_ptr + token) * stride_slot
    key = slot_base + (heads - num_heads)[:, None] * stride_head + cols[None, :]
    key_mask = mask & (heads >= num_heads)[:, None]
    tl.store(key, first, mask=key_mask)
    tl.store(key + half, second, mask=key_mask)
    kv = tl.arange(0, KV_HEADS)  # [KV]: the v heads, copied whole
    dims = tl.arange(0, 2 * BLOCK)
    v_mask = (kv < num_kv)[:, None] & (dims < 2 * half)[None, :]
    value = qkv_ptr + token * stride_t + (num_heads + num_kv + kv)[:, None] * stride_h + dims[None, :]
    cache_value = slot_base + stride_kv + kv[:, None] * stride_head + dims[None, :]
    tl.store(cache_value, tl.load(value, mask=v_mask), mask=v_mask)


def rope_write_kv_(
    qkv: torch.Tensor,  # [T, H + 2 KVH, D], head dims contiguous
    num_heads: int,
    positions: torch.Tensor,  # [T] int64
    cos: torch.Tensor,  # [P, D/2] float32
    sin: torch.Tensor,  # [P, D/2] float32
    kv_cache: torch.Tensor,  # [num_blocks, block_size, 2, KVH, D], contiguous
    slot_mapping: torch.Tensor,  # [T] int64
) -> None:
    num_tokens, width, head_dim = qkv.shape
    num_kv = (width - num_heads) // 2
    if num_tokens:
        _rope_write_kv_kernel[(num_tokens,)](
            qkv, positions, slot_mapping, cos, sin, kv_cache, qkv.stride(0), qkv.stride(1), cos.stride(0),
            kv_cache.stride(1), kv_cache.stride(2), kv_cache.stride(3), num_heads, num_kv, head_dim // 2,
            BLOCK=triton.next_power_of_2(head_dim // 2), HEADS=triton.next_power_of_2(num_heads + num_kv),
            KV_HEADS=triton.next_power_of_2(num_kv),
        )  # fmt: skip


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:  # [T, dim]
    out = torch.empty_like(x)
    _launch_norm(x, None, weight, out, eps)
    return out


def add_rms_norm_(x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x += delta in place ([T, dim] each); returns RMSNorm(x) * weight."""
    out = torch.empty_like(x)
    _launch_norm(x, delta, weight, out, eps)
    return out


def _launch_norm(
    x: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, out: torch.Tensor, eps: float
) -> None:
    num_rows, dim = x.shape
    if num_rows == 0:
        return
    _rms_norm_kernel[(num_rows,)](
        x,
        x if delta is None else delta,
        weight,
        out,
        x.stride(0),
        0 if delta is None else delta.stride(0),
        out.stride(0),
        dim,
        eps,
        HAS_DELTA=delta is not None,
        BLOCK=triton.next_power_of_2(dim),
    )


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:  # [T, 2I] (gate | up) -> [T, I]
    num_rows, inter = gate_up.shape[0], gate_up.shape[1] // 2
    out = gate_up.new_empty(num_rows, inter)
    block = min(1024, triton.next_power_of_2(inter))
    if num_rows:
        _silu_mul_kernel[(num_rows, triton.cdiv(inter, block))](
            gate_up, out, gate_up.stride(0), out.stride(0), inter, BLOCK=block
        )
    return out


def rope_(
    x: torch.Tensor,  # [T, heads, D], head dims contiguous; rotated in place (rotate-half layout)
    positions: torch.Tensor,  # [T] int64
    cos: torch.Tensor,  # [P, D/2] float32
    sin: torch.Tensor,  # [P, D/2] float32
) -> None:
    num_tokens, num_heads, head_dim = x.shape
    half = head_dim // 2
    if num_tokens:
        _rope_kernel[(num_tokens, num_heads)](
            x,
            positions,
            cos,
            sin,
            x.stride(0),
            x.stride(1),
            cos.stride(0),
            half,
            BLOCK=triton.next_power_of_2(half),
        )
