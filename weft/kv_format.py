"""The KV cache's element formats (`kv_cache_dtype`): a float dtype, or Q8_0 blocks.

A Q8_0 cache keeps each run of 32 elements of a head as llama.cpp's `block_q8_0`: a float16 scale,
then 32 int8 values (34 bytes for 32 elements, against 64 in float16 and 128 in float32). Such a
cache is a uint8 tensor [blocks, block_size, 2, KVH, D / 32 * 34]: every operation on whole blocks
and slots (copy-on-write, forks, the pools' scratch blocks) is unchanged, and only the kernels that
write and read a head's row know the layout (weft/native/ops.h, `BlockQ8`). Writing rounds as
llama.cpp's `quantize_row_q8_0_ref`; reading computes scale * q in float32, as gguf's reference
dequantization does, so that the native kernels and this torch path (gguf's own quantizer and
dequantizer) read the same numbers.
"""

from __future__ import annotations

import numpy as np
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
    """Q8_0 blocks of x's last dimension (a multiple of 32): gguf's reference quantizer, llama.cpp's
    quantize_row_q8_0_ref (as weft/model/quantize.py quantizes matrices)."""
    from gguf import GGMLQuantizationType
    from gguf.quants import quantize

    blocks = quantize(x.detach().float().contiguous().numpy(), GGMLQuantizationType.Q8_0)
    return torch.from_numpy(np.ascontiguousarray(blocks))


def dequantize_q8_0(data: torch.Tensor) -> torch.Tensor:  # [..., nb * 34] uint8 -> [..., nb * 32] float32
    """gguf's dequantization: each block's float16 scale times its int8s, in float32."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    values = dequantize(data.contiguous().numpy(), GGMLQuantizationType.Q8_0)
    return torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32))


def widened(cache_rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Rows gathered from a cache ([..., row]) as `dtype` values ([..., D])."""
    return dequantize_q8_0(cache_rows).to(dtype) if cache_rows.dtype == Q8_0 else cache_rows.to(dtype)


def to_cache_rows(rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Keys or values ([..., D]) as a cache of `dtype` stores them ([..., row])."""
    return quantize_q8_0(rows) if dtype == Q8_0 else rows.to(dtype)
