"""An MLP's gate|up projection, its activation and the down projection in two kernel calls, where
both matrices are bfloat16 panels multiplied in bfloat16 (`Linear.bf16_dot`: AVX512_BF16 CPUs).

`packed_glu_pairs` (weft/native/linear.cpp) computes a tile of half a gate panel and half the up
panel of the same MLP columns (as many accumulators as a whole-panel tile, the same panel bytes per
multiply-add) and stores silu(gate) * up already rounded to bfloat16 pairs in the layout the down
projection's tiles read (`packed_linear_pairs`). Neither the [T, 2I] product nor the float32 [T, I]
activation reaches memory, and the down projection has nothing left to convert: bit for bit what
the product, `silu_mul` and the down projection's own rounding give.
"""

from __future__ import annotations

import torch

from weft.model.layers import BFloat16Pairs, Linear, num_rows


def fuses(gate_up: Linear, down: Linear) -> bool:
    """Whether `glu_down` runs for these matrices: bfloat16 products in both, no gate|up bias, and
    a multiple of 32 MLP columns (so that a gate panel and an up panel hold the same columns)."""
    return gate_up.bf16_dot and down.bf16_dot and gate_up.bias is None and gate_up.out_features % 64 == 0


def glu_down(gate_up: Linear, down: Linear, x: torch.Tensor | BFloat16Pairs) -> torch.Tensor:
    """down(silu(gate) * up) of x ([T, hidden] -> [T, out]), for matrices that `fuses`; x float32 or
    already the bfloat16 pairs that its norm wrote."""
    inter, rows = gate_up.out_features // 2, num_rows(x)
    if isinstance(x, BFloat16Pairs):
        pairs = torch.ops.weft.packed_glu_pairs_from_pairs(x.words, rows, gate_up.weight, inter)
    else:
        pairs = torch.ops.weft.packed_glu_pairs(x, gate_up.weight, inter)  # [tiles, I / 2, rows]
    return torch.ops.weft.packed_linear_pairs(pairs, rows, down.weight, down.bias, down.out_features)
