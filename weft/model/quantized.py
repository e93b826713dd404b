"""Quantized matrices kept in their blocks (GGUF's Q8_0 for now) on their way from the file to the
panels of weft's CPU kernels (`weft/native/quant.cpp`, `linear.cpp`).

A matrix arrives as its rows of blocks, uint8 [N, K / 32 * 34] (Q8_0: per block a float16 scale and
32 int8 quants), under its Hugging Face name; the loader fuses q/k/v and gate/up by concatenating
rows (`cat_rows`: blocks of different types are dequantized to float32 first), checks shapes by the
logical [N, K] (`logical_shape`), and packs every one into Q8_0 panels (`pack_q8_0`) before the
weights are assigned. Nothing above `weft/model` sees the format.
"""

from __future__ import annotations

import torch

Q8_0_BLOCK = 32  # input features per block
Q8_0_BLOCK_BYTES = 34  # a float16 scale and 32 int8 quants


def is_q8_0_rows(tensor: torch.Tensor) -> bool:
    """Whether `tensor` is a Q8_0 matrix's rows of blocks (the only uint8 weights the loader sees)."""
    return tensor.dtype == torch.uint8 and tensor.dim() == 2


def logical_shape(tensor: torch.Tensor) -> tuple[int, ...]:
    """The [N, K] a weight stands for: its own shape, or a Q8_0 matrix's."""
    if is_q8_0_rows(tensor):
        return tensor.shape[0], tensor.shape[1] // Q8_0_BLOCK_BYTES * Q8_0_BLOCK
    return tuple(tensor.shape)


def dequantize_q8_0(rows: torch.Tensor) -> torch.Tensor:  # uint8 [N, K / 32 * 34] -> float32 [N, K]
    blocks = rows.view(rows.shape[0], -1, Q8_0_BLOCK_BYTES)  # [N, K / 32, 34]
    scales = blocks[..., :2].contiguous().view(torch.float16).float()  # [N, K / 32, 1]
    quants = blocks[..., 2:].contiguous().view(torch.int8).float()  # [N, K / 32, 32]
    return (scales * quants).reshape(rows.shape[0], -1)


def cat_rows(parts: list[torch.Tensor]) -> torch.Tensor:
    """Matrices stacked by rows (a fused q/k/v or gate/up): in Q8_0 when every part is, else float32."""
    if all(is_q8_0_rows(p) for p in parts):
        return torch.cat(parts)
    return torch.cat([dequantize_q8_0(p) if is_q8_0_rows(p) else p for p in parts])


def dequantized(tensor: torch.Tensor) -> torch.Tensor:
    """A weight as float32 where it was kept in Q8_0 blocks (an untied embedding table, a device
    without weft's CPU kernels)."""
    return dequantize_q8_0(tensor) if is_q8_0_rows(tensor) else tensor


def pack_q8_0(rows: torch.Tensor) -> torch.Tensor:  # uint8 [N, K / 32 * 34] -> [ceil(N / 32), K / 32, 1088]
    return torch.ops.weft.pack_q8_0(rows)


__all__ = ["cat_rows", "dequantize_q8_0", "dequantized", "is_q8_0_rows", "logical_shape", "pack_q8_0"]
