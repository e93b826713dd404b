"""The KV cache's element formats (`kv_cache_dtype`): a float dtype, or Q8_0 blocks.

A Q8_0 cache keeps each run of 32 elements of a head as llama.cpp's `block_q8_0`: a float16 scale,
then 32 int8 values (34 bytes for 32 elements, against 64 in float16 and 128 in float32). Such a
cache is a uint8 tensor [blocks, block_size, 2, KVH, D / 32 * 34]: every operation on whole blocks
and slots (copy-on-write, forks, the pools' scratch blocks) is unchanged, and only the kernels that
write and read a head's row know the layout (weft/native/ops.h, `BlockQ8`). Writing rounds as
llama.cpp's `quantize_row_q8_0_ref`; reading computes scale * q in float32, as gguf's reference
dequantization does, so that the native kernels and this torch path read the same numbers.
"""

from __future__ import annotations

import torch

Q8_0 = torch.uint8  # the dtype of a KV cache kept in Q8_0 blocks
Q8_ELEMENTS, Q8_BYTES = 32, 34  # a block's elements and bytes


def kv_dtype_name(dtype: torch.dtype) -> str:
    """The name `kv_cache_dtype` takes for a cache of this dtype: "q8_0", "float16", ..."""
    return "q8_0" if dtype == Q8_0 else str(dtype).removeprefix("torch.")


def cache_row_size(head_dim: int, dtype: torch.dtype) -> int:
    """The cache tensor's last dimension for heads of `head_dim` elements (Q8_0: bytes)."""
    return head_dim // Q8_ELEMENTS * Q8_BYTES if dtype == Q8_0 else head_dim


def quantize_q8_0(x: torch.Tensor) -> torch.Tensor:  # [..., D] float -> [..., D / 32 * 34] uint8
    """Q8_0 blocks of x's last dimension (a multiple of 32), rounded as llama.cpp rounds them:
    scale = the block's largest magnitude / 127, stored as float16; each element round(x / scale)
    with the unrounded scale, halves away from zero (C's roundf, not torch's round to even)."""
    blocks = x.float().reshape(*x.shape[:-1], -1, Q8_ELEMENTS)  # [..., nb, 32]
    scale = blocks.abs().amax(dim=-1, keepdim=True) / 127  # [..., nb, 1]
    inverse = torch.where(scale != 0, 1 / scale, torch.zeros_like(scale))
    scaled = blocks * inverse
    truncated = scaled.trunc()
    halfway = (scaled - truncated).abs() == 0.5
    quants = torch.where(halfway, truncated + scaled.sign(), scaled.round()).to(torch.int8)  # [..., nb, 32]
    scale_bytes = scale.half().view(torch.uint8)  # [..., nb, 2], little-endian float16
    packed = torch.cat([scale_bytes, quants.view(torch.uint8)], dim=-1)  # [..., nb, 34]
    return packed.reshape(*x.shape[:-1], -1)


def dequantize_q8_0(data: torch.Tensor) -> torch.Tensor:  # [..., nb * 34] uint8 -> [..., nb * 32] float32
    blocks = data.reshape(*data.shape[:-1], -1, Q8_BYTES)  # [..., nb, 34]
    scale = blocks[..., :2].contiguous().view(torch.float16).float()  # [..., nb, 1]
    quants = blocks[..., 2:].contiguous().view(torch.int8).float()  # [..., nb, 32]
    return (scale * quants).reshape(*data.shape[:-1], -1)


def widened(cache_rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Rows gathered from a cache ([..., row]) as `dtype` values ([..., D])."""
    return dequantize_q8_0(cache_rows).to(dtype) if cache_rows.dtype == Q8_0 else cache_rows.to(dtype)


def to_cache_rows(rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Keys or values ([..., D]) as a cache of `dtype` stores them ([..., row])."""
    return quantize_q8_0(rows) if dtype == Q8_0 else rows.to(dtype)
