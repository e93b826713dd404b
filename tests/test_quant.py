"""Quantized panels (weft/native/quant.cpp, linear.cpp; weft/model/quantized.py): GGUF Q8_0 and
Q4_K blocks packed into panels and multiplied in their quantized form, against the product of the
matrix that `gguf.quants.dequantize` makes of the same blocks, on every tile height and odd size."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import require_native_kernels

from weft.model.quantized import PartedRows, QuantizedRows, as_q8_0, cat_rows, logical_shape


@pytest.fixture(scope="module", autouse=True)
def kernels():
    require_native_kernels()


def random_scales(gen: np.random.Generator, shape: tuple[int, ...], extreme: bool) -> np.ndarray:
    """Random float16 block scales: normal around 0.02 or, with `extreme`, from 6e-8 to 6e4 and zero."""
    if extreme:
        choices = np.array([6e-8, 1e-4, 0.0, 1.0, 60000.0, -3e-3], dtype=np.float16)
        return gen.choice(choices, shape).astype(np.float16)
    return gen.normal(0, 0.02, shape).astype(np.float16)


def random_q8_0(rows: int, in_features: int, seed: int, extreme: bool = False) -> torch.Tensor:
    """Random Q8_0 rows of blocks, uint8 [rows, in / 32 * 34]: random float16 scales (with `extreme`,
    from 6e-8 to 6e4 and zero) and random int8 quants over the whole range."""
    gen = np.random.default_rng(seed)
    blocks = in_features // 32
    scales = random_scales(gen, (rows, blocks, 1), extreme)
    quants = gen.integers(-128, 128, (rows, blocks, 32), dtype=np.int8)
    raw = np.concatenate([scales.view(np.uint8), quants.view(np.uint8)], axis=2)  # [rows, blocks, 34]
    return torch.from_numpy(raw.reshape(rows, blocks * 34).copy())


def random_legacy(kind: str, rows: int, in_features: int, seed: int, extreme: bool = False) -> torch.Tensor:
    """Random Q4_0, Q5_0, Q4_1 or Q5_1 rows of blocks, uint8 [rows, in / 32 * 18, 22, 20 or 24]:
    random float16 scales d (and mins m; with `extreme`, from 6e-8 to 6e4 and zero) and random bytes
    (every byte string is a valid block)."""
    gen = np.random.default_rng(seed)
    blocks, size = in_features // 32, {"q4_0": 18, "q5_0": 22, "q4_1": 20, "q5_1": 24}[kind]
    raw = gen.integers(0, 256, (rows, blocks, size), dtype=np.uint8)
    raw[..., :2] = random_scales(gen, (rows, blocks, 1), extreme).view(np.uint8)
    if kind in ("q4_1", "q5_1"):  # m, signed like d
        raw[..., 2:4] = random_scales(gen, (rows, blocks, 1), extreme).view(np.uint8)
    return torch.from_numpy(raw.reshape(rows, blocks * size).copy())


def random_q5_k(rows: int, in_features: int, seed: int, extreme: bool = False) -> torch.Tensor:
    """Random Q5_K rows of super-blocks, uint8 [rows, in / 256 * 176]: float16 d and dmin (with
    `extreme` over the float16 range), random 6-bit scales and mins, fifth bits and nibbles."""
    gen = np.random.default_rng(seed)
    blocks = in_features // 256
    scale = 60000.0 if extreme else 0.01
    d = np.clip(gen.standard_normal((rows, blocks, 2)) * scale, -6e4, 6e4).astype(np.float16)
    rest = gen.integers(0, 256, (rows, blocks, 172), dtype=np.uint8)  # scales, mins, qh, qs
    raw = np.concatenate([d.view(np.uint8), rest], axis=2)
    return torch.from_numpy(raw.reshape(rows, blocks * 176).copy())


def random_q4_k(rows: int, in_features: int, seed: int, extreme: bool = False) -> torch.Tensor:
    """Random Q4_K rows of super-blocks, uint8 [rows, in / 256 * 144]: float16 d and dmin (with
    `extreme` over the float16 range), random 6-bit scales and mins, random 4-bit quants."""
    gen = np.random.default_rng(seed)
    blocks = in_features // 256
    scale = 60000.0 if extreme else 0.01
    d = np.clip(gen.standard_normal((rows, blocks, 2)) * scale, -6e4, 6e4).astype(np.float16)
    rest = gen.integers(0, 256, (rows, blocks, 140), dtype=np.uint8)  # scales, mins, quants
    raw = np.concatenate([d.view(np.uint8), rest], axis=2)
    return torch.from_numpy(raw.reshape(rows, blocks * 144).copy())


LOW_BIT_SIZES = {"q2_k": 84, "q3_k": 110, "iq4_nl": 18, "iq4_xs": 136}
LOW_BIT_BLOCK = {"q2_k": 256, "q3_k": 256, "iq4_nl": 32, "iq4_xs": 256}
LOW_BIT_SCALES_AT = {
    "q2_k": (80, 82),
    "q3_k": (108,),
    "iq4_nl": (0,),
    "iq4_xs": (0,),
}  # float16 scales' offsets


def random_low_bit(kind: str, rows: int, in_features: int, seed: int, scale: float = 0.01) -> torch.Tensor:
    """Random rows of `kind`'s blocks, uint8 [rows, in / block * size]: random bytes (every byte
    string is a valid block) with float16 scales drawn normal(0, `scale`)."""
    gen = np.random.default_rng(seed)
    blocks, size = in_features // LOW_BIT_BLOCK[kind], LOW_BIT_SIZES[kind]
    raw = gen.integers(0, 256, (rows, blocks, size), dtype=np.uint8)
    for at in LOW_BIT_SCALES_AT[kind]:
        d = gen.normal(0, scale, (rows, blocks, 1)).astype(np.float16)
        raw[..., at : at + 2] = d.view(np.uint8)
    return torch.from_numpy(raw.reshape(rows, -1).copy())


def random_mxfp4(rows: int, in_features: int, seed: int, extreme: bool = False) -> torch.Tensor:
    """Random MXFP4 rows (gpt-oss's experts), uint8 [rows, in / 32 * 17]: random codes under E8M0
    exponents e (weights kvalue * 2^(e - 128)) about a real model's, 2^-10 to 2^0, or with `extreme`
    from 2^-108 to 2^32."""
    gen = np.random.default_rng(seed)
    raw = gen.integers(0, 256, (rows, in_features // 32, 17), dtype=np.uint8)
    raw[..., 0] = gen.integers(20, 161, raw.shape[:2]) if extreme else gen.integers(118, 129, raw.shape[:2])
    return torch.from_numpy(raw.reshape(rows, -1).copy())


def reference_dequantize(raw: torch.Tensor, kind: str = "Q8_0") -> torch.Tensor:
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    return torch.from_numpy(dequantize(raw.numpy(), GGMLQuantizationType[kind]).astype(np.float32))


def random_q6_k(rows: int, in_features: int, seed: int) -> torch.Tensor:
    """Random Q6_K rows of super-blocks, uint8 [rows, in / 256 * 210]: random 6-bit quants (ql, qh),
    int8 sub-block scales and a float16 d."""
    gen = np.random.default_rng(seed)
    blocks = in_features // 256
    quants = gen.integers(0, 256, (rows, blocks, 208), dtype=np.uint8)  # ql, qh, scales
    d = (gen.standard_normal((rows, blocks, 1)) * 0.001).astype(np.float16)
    raw = np.concatenate([quants, d.view(np.uint8)], axis=2)
    return torch.from_numpy(raw.reshape(rows, blocks * 210).copy())


@pytest.mark.parametrize("rows", [1, 2, 5, 12, 13, 25])
def test_q6_k_panels_compute_the_dequantized_product_and_embedding_rows(rows):
    """Q6_K: each weight (d * sc) * q as the dequantization rounds it: the float32 panel product of
    the dequantized matrix, bit for bit; and rows of a tied Q6_K table looked up exactly."""
    raw = random_q6_k(70, 512, seed=rows)
    weight = reference_dequantize(raw, "Q6_K")
    assert torch.equal(QuantizedRows("q6_k", raw).dequantize(), weight)
    x = torch.randn(rows, 512, generator=torch.Generator().manual_seed(rows))
    panels = torch.ops.weft.pack_q6_k(raw)
    assert panels.shape == (3, 2, 8768)
    out = torch.ops.weft.packed_linear(x, panels, None, 70)
    assert torch.equal(
        out, torch.ops.weft.packed_linear(x, torch.ops.weft.pack_linear_weight(weight), None, 70)
    )
    ids = torch.tensor([0, 31, 32, 69, rows])
    assert torch.equal(torch.ops.weft.embedding_from_panels(ids, panels, 70, 512), weight[ids])


@pytest.mark.parametrize("rows", [1, 2, 3, 5, 7, 12, 13, 25])
@pytest.mark.parametrize("in_features", [256, 512])
def test_q4_k_panels_compute_the_dequantized_product(rows, in_features):
    """Q4_K: each weight d * sc * q - dmin * m as the dequantization rounds it, accumulated as a
    float32 panel of the dequantized matrix: equal, bit for bit (70 columns: a last panel of 6)."""
    raw = random_q4_k(70, in_features, seed=rows)
    weight = reference_dequantize(raw, "Q4_K")
    assert torch.equal(QuantizedRows("q4_k", raw).dequantize(), weight)
    x = torch.randn(rows, in_features, generator=torch.Generator().manual_seed(rows))
    panels = torch.ops.weft.pack_q4_k(raw)
    assert panels.shape == (3, in_features // 256, 4736)
    out = torch.ops.weft.packed_linear(x, panels, None, 70)
    assert torch.equal(
        out, torch.ops.weft.packed_linear(x, torch.ops.weft.pack_linear_weight(weight), None, 70)
    )
    big = random_q4_k(40, 256, seed=rows, extreme=True)
    expected = torch.nn.functional.linear(x[:, :256].double(), reference_dequantize(big, "Q4_K").double())
    out = torch.ops.weft.packed_linear(x[:, :256].contiguous(), torch.ops.weft.pack_q4_k(big), None, 40)
    torch.testing.assert_close(out.double(), expected, rtol=1e-4, atol=1e-3 * expected.abs().max().item())


@pytest.mark.parametrize("rows", [*range(1, 14), 16, 25, 40])
@pytest.mark.parametrize("in_features", [32, 96])
@pytest.mark.parametrize("bias", [True, False])
def test_q8_0_panels_compute_the_dequantized_product(rows, in_features, bias):
    """The product from Q8_0 panels is the float32 product of the dequantized matrix, computed in
    the same order as its float32 panels compute it: equal, bit for bit (77 columns: a last panel
    of 13)."""
    raw = random_q8_0(77, in_features, seed=rows)
    weight = reference_dequantize(raw)  # [77, K]
    quantized = QuantizedRows("q8_0", raw)
    assert torch.equal(quantized.dequantize(), weight) and logical_shape(quantized) == (77, in_features)
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
    x = torch.randn(5, 64, generator=torch.Generator().manual_seed(3))
    expected = torch.nn.functional.linear(x.double(), weight.double())
    # float32 sums of terms up to 60000 * 127 * |x| cancel: bound the error by the terms' magnitude
    magnitude = torch.nn.functional.linear(x.double().abs(), weight.double().abs())
    error = (torch.ops.weft.packed_linear(x, panels, None, 70).double() - expected).abs()
    assert (error <= 1e-5 * magnitude + 1e-2).all(), (error / magnitude).max()
    ids = torch.tensor([0, 31, 32, 69, 5])
    assert torch.equal(torch.ops.weft.embedding_from_panels(ids, panels, 70, 64), weight[ids])


def test_q8_0_rows_fuse_and_bad_inputs_are_errors():
    q, k = (
        QuantizedRows("q8_0", random_q8_0(64, 256, seed=1)),
        QuantizedRows("q8_0", random_q8_0(32, 256, seed=2)),
    )
    fused = cat_rows([q, k])  # in their blocks
    assert isinstance(fused, QuantizedRows) and torch.equal(fused.rows, torch.cat([q.rows, k.rows]))
    v = QuantizedRows("q4_k", random_q4_k(32, 256, seed=3))
    mixed = cat_rows([q, k, v])  # another kind in whole panels: in parts (test_quant_types.py)
    assert isinstance(mixed, PartedRows) and torch.equal(mixed.dequantize()[96:], v.dequantize())
    odd = cat_rows([q, k, QuantizedRows("q4_k", random_q4_k(40, 256, seed=3))])  # not whole panels
    assert isinstance(odd, torch.Tensor) and odd.shape == (136, 256)
    with pytest.raises(RuntimeError, match="Q8_0 tensor's rows"):
        torch.ops.weft.pack_q8_0(torch.zeros(4, 33, dtype=torch.uint8))
    with pytest.raises(RuntimeError, match="Q4_K tensor's rows"):
        torch.ops.weft.pack_q4_k(torch.zeros(4, 145, dtype=torch.uint8))
    panels = torch.ops.weft.pack_q8_0(q.rows)
    with pytest.raises(RuntimeError, match="uint8 weights must be Q8_0, Q4_K or Q6_K panels"):
        torch.ops.weft.packed_linear(torch.randn(2, 32), panels, None, 64)
    with pytest.raises(RuntimeError, match="bf16_dot needs bfloat16 panels"):
        torch.ops.weft.packed_linear(torch.randn(2, 256), panels, None, 64, True)


@pytest.mark.parametrize("kind", ["Q4_0", "Q5_0"])
def test_q4_0_and_q5_0_become_q8_0_blocks_exactly(kind):
    """Q4_0 (d * (q - 8)) and Q5_0 (d * (q - 16), the fifth bits apart) run as Q8_0 blocks under the
    same scales: the same dequantized matrix, bit for bit (random bytes are valid blocks)."""
    size = {"Q4_0": 18, "Q5_0": 22}[kind]
    gen = np.random.default_rng(7)
    blocks = gen.integers(0, 256, (40, 3, size), dtype=np.uint8)
    blocks[..., :2] = (gen.standard_normal((40, 3, 1)) * 0.01).astype(np.float16).view(np.uint8)
    raw = blocks.reshape(40, 3 * size)
    converted = as_q8_0(QuantizedRows(kind.lower(), torch.from_numpy(raw)))
    assert converted.kind == "q8_0" and converted.shape == (40, 96)
    assert torch.equal(converted.dequantize(), reference_dequantize(torch.from_numpy(raw), kind))
