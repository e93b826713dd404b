"""Quantized panels (weft/native/quant.cpp, linear.cpp; weft/model/quantized.py): GGUF Q8_0 blocks
packed into panels and multiplied in their quantized form, against the product of the matrix that
`gguf.quants.dequantize` makes of the same blocks, on every tile height and odd size."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

import weft.native as native
from weft.model.quantized import cat_rows, dequantize_q8_0, logical_shape


@pytest.fixture(scope="module", autouse=True)
def kernels():
    if not native.kernels_available():
        if os.environ.get("CI"):
            pytest.fail("the CPU kernels must build in CI (g++ and ninja are expected there)")
        pytest.skip("weft's CPU kernels are off (WEFT_NATIVE=0) or could not be built here")


def random_q8_0(rows: int, in_features: int, seed: int, extreme: bool = False) -> torch.Tensor:
    """Random Q8_0 rows of blocks, uint8 [rows, in / 32 * 34]: random float16 scales (with `extreme`,
    from 6e-8 to 6e4 and zero) and random int8 quants over the whole range."""
    gen = np.random.default_rng(seed)
    blocks = in_features // 32
    scales = gen.normal(0, 0.02, (rows, blocks, 1)).astype(np.float16)
    if extreme:
        choices = np.array([6e-8, 1e-4, 0.0, 1.0, 60000.0, -3e-3], dtype=np.float16)
        scales = gen.choice(choices, (rows, blocks, 1)).astype(np.float16)
    quants = gen.integers(-128, 128, (rows, blocks, 32), dtype=np.int8)
    raw = np.concatenate([scales.view(np.uint8), quants.view(np.uint8)], axis=2)  # [rows, blocks, 34]
    return torch.from_numpy(raw.reshape(rows, blocks * 34).copy())


def reference_dequantize(raw: torch.Tensor) -> torch.Tensor:
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    return torch.from_numpy(dequantize(raw.numpy(), GGMLQuantizationType.Q8_0).astype(np.float32))


@pytest.mark.parametrize("rows", [*range(1, 14), 16, 25, 40])
@pytest.mark.parametrize("in_features", [32, 96])
@pytest.mark.parametrize("bias", [True, False])
def test_q8_0_panels_compute_the_dequantized_product(rows, in_features, bias):
    """The product from Q8_0 panels is the float32 product of the dequantized matrix, computed in
    the same order as its float32 panels compute it: equal, bit for bit (77 columns: a last panel
    of 13)."""
    raw = random_q8_0(77, in_features, seed=rows)
    weight = reference_dequantize(raw)  # [77, K]
    assert torch.equal(dequantize_q8_0(raw), weight) and logical_shape(raw) == (77, in_features)
    gen = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, in_features, generator=gen)
    b = torch.randn(77, generator=gen) if bias else None
    panels = torch.ops.weft.pack_q8_0(raw)
    assert panels.shape == (3, in_features // 32, 1088) and panels.dtype == torch.uint8
    out = torch.ops.weft.packed_linear(x, panels, b, 77)
    assert torch.equal(out, torch.ops.weft.packed_linear(x, torch.ops.weft.pack_linear_weight(weight), b, 77))
    torch.testing.assert_close(out, torch.nn.functional.linear(x, weight, b), rtol=1e-5, atol=1e-5)


def test_q8_0_extreme_scales_and_embedding_rows():
    raw = random_q8_0(70, 64, seed=3, extreme=True)
    weight = reference_dequantize(raw)
    panels = torch.ops.weft.pack_q8_0(raw)
    x = torch.randn(5, 64)
    expected = torch.nn.functional.linear(x.double(), weight.double()).float()
    torch.testing.assert_close(
        torch.ops.weft.packed_linear(x, panels, None, 70), expected, rtol=1e-4, atol=1e-2
    )
    ids = torch.tensor([0, 31, 32, 69, 5])
    assert torch.equal(torch.ops.weft.embedding_from_panels(ids, panels, 70, 64), weight[ids])


def test_q8_0_rows_fuse_and_bad_inputs_are_errors():
    q, k = random_q8_0(64, 64, seed=1), random_q8_0(32, 64, seed=2)
    assert torch.equal(cat_rows([q, k]), torch.cat([q, k]))  # fused in their blocks
    mixed = cat_rows([q, reference_dequantize(k)])  # a float part: all dequantized
    assert mixed.dtype == torch.float32 and torch.equal(mixed[:64], reference_dequantize(q))
    with pytest.raises(RuntimeError, match="Q8_0 tensor's rows"):
        torch.ops.weft.pack_q8_0(torch.zeros(4, 33, dtype=torch.uint8))
    panels = torch.ops.weft.pack_q8_0(q)
    with pytest.raises(RuntimeError, match="uint8 weights must be Q8_0 panels"):
        torch.ops.weft.packed_linear(torch.randn(2, 32), panels, None, 64)
    with pytest.raises(RuntimeError, match="bf16_dot needs bfloat16 panels"):
        torch.ops.weft.packed_linear(torch.randn(2, 64), panels, None, 64, True)
