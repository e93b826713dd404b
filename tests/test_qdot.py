"""Quantized products with int8 activations (weft/native/qdot.cpp; dot panels packed by quant.cpp):
the activations rounded bit for bit as llama.cpp's x86 code rounds them (quantize_row_q8_0 for Q8_0
weights, quantize_row_q8_K for k-quants), and each kind's product equal to the float64 product of
those rounded activations with the weights `gguf.quants.dequantize` makes of the same blocks, on
every tile height, odd sizes and extreme scales. Run on every ISA build (test_half_precision.py):
vpdpbusd, vpmaddubsw on AVX-512BW and AVX2, and the scalar loop."""

from __future__ import annotations

import functools

import numpy as np
import pytest
import torch
from conftest import require_native_kernels
from test_quant import (
    random_legacy,
    random_low_bit,
    random_mxfp4,
    random_q4_k,
    random_q5_k,
    random_q6_k,
    random_q8_0,
    reference_dequantize,
)

from weft.model.quantized import MixedRows, QuantizedRows, cat_rows

RANDOM = {
    "q8_0": random_q8_0,
    "q4_0": lambda n, k, seed, extreme=False: random_legacy("q4_0", n, k, seed, extreme),
    "q5_0": lambda n, k, seed, extreme=False: random_legacy("q5_0", n, k, seed, extreme),
    "q4_1": lambda n, k, seed, extreme=False: random_legacy("q4_1", n, k, seed, extreme),
    "q5_1": lambda n, k, seed, extreme=False: random_legacy("q5_1", n, k, seed, extreme),
    "q4_k": random_q4_k,
    "q5_k": random_q5_k,
    "q6_k": random_q6_k,
    **{kind: functools.partial(random_low_bit, kind) for kind in ("q2_k", "q3_k", "iq4_nl", "iq4_xs")},
    "mxfp4": random_mxfp4,
}
BLOCK_BYTES = {("q8_0", False): 1088, ("q4_0", False): 576, ("q5_0", False): 704, ("q4_k", False): 4736}
BLOCK_BYTES |= {("q4_1", False): 640, ("q5_1", False): 768}
BLOCK_BYTES |= {("q6_k", False): 6720, ("q4_k", True): 7296, ("q6_k", True): 7296, ("q5_k", True): 7296}
BLOCK_BYTES |= {("q5_k", False): 5760}
BLOCK_BYTES |= {("q2_k", True): 7296, ("q3_k", False): 6720, ("q3_k", True): 7296, ("iq4_nl", False): 2304}
BLOCK_BYTES |= {("iq4_xs", False): 4608, ("q2_k", False): 3200, ("q3_k", False): 3648, ("mxfp4", False): 544}
PANEL_BLOCK = {"iq4_nl": 128}  # input features per dot panel block, where not the activations' block
SMALL_BLOCKS = (
    "q8_0",
    "q4_0",
    "q5_0",
    "q4_1",
    "q5_1",
    "iq4_nl",
    "mxfp4",
)  # blocks of 32 features: activations too


@pytest.fixture(scope="module", autouse=True)
def kernels():
    require_native_kernels()


def rounded_activations(x: torch.Tensor, kind: str, dtype: type = np.float64) -> torch.Tensor:
    """x as llama.cpp's x86 code rounds it before a quantized product, q * d in `dtype`: for Q8_0
    weights blocks of 32, q = rint(x * (127 / max|x|)), d = float16(max|x| / 127); for k-quants
    blocks of 256, the same q and d = 1 / (127 / max|x|) in float32."""
    block = 32 if kind in SMALL_BLOCKS else 256
    m, k = x.shape
    blocks = x.numpy().reshape(m, k // block, block)
    amax = np.fmax.reduce(np.abs(blocks), axis=-1, keepdims=True)  # float32, NaN left out
    with np.errstate(divide="ignore", invalid="ignore"):
        inv = np.where(amax > 0, np.float32(127) / amax, np.float32(0)).astype(np.float32)
        if kind in SMALL_BLOCKS:
            d = (amax / np.float32(127)).astype(np.float16).astype(np.float32)
        else:
            d = np.where(inv > 0, np.float32(1) / inv, np.float32(0)).astype(np.float32)
        q = np.rint(blocks * inv)  # float32 products, rounded to nearest even
    q = np.where(np.abs(q) <= 127, q, 0)  # a non-finite x: 0
    return torch.from_numpy((q.astype(dtype) * d.astype(dtype)).reshape(m, k))


def reference_product(x: torch.Tensor, raw: torch.Tensor, kind: str) -> torch.Tensor:
    """The product llama.cpp computes, in float64: the rounded activations times the dequantized
    weights; for Q4_1 and Q5_1 (d * q + m) the d * q part so, and the min term m * s with llama.cpp's
    s = float16(max|x| / 127 * sum(q)) of each activation block (quantize_row_q8_1)."""
    xq = rounded_activations(x, kind)
    if kind not in ("q4_1", "q5_1"):
        return xq @ reference_dequantize(raw, kind.upper()).double().T
    n, size = raw.shape[0], {"q4_1": 20, "q5_1": 24}[kind]
    blocks = raw.numpy().reshape(n, -1, size).copy()
    mins = blocks[..., 2:4].copy().view(np.float16).astype(np.float64)[..., 0]  # [N, B]
    blocks[..., 2:4] = 0
    scaled = reference_dequantize(torch.from_numpy(blocks.reshape(n, -1)), kind.upper()).double()  # d * q
    m, k = x.shape
    parts = x.numpy().reshape(m, k // 32, 32)
    amax = np.abs(parts).max(axis=-1)  # float32 [M, B]
    with np.errstate(divide="ignore", invalid="ignore"):
        inv = np.where(amax > 0, np.float32(127) / amax, np.float32(0)).astype(np.float32)
    sums = np.rint(parts * inv[..., None]).sum(axis=-1).astype(np.float32)
    s = (amax / np.float32(127) * sums).astype(np.float16).astype(np.float64)  # [M, B]
    return xq @ scaled.T + torch.from_numpy(s) @ torch.from_numpy(mins).T


def identity_rows(kind: str, k: int) -> torch.Tensor:
    """GGUF rows of a [K, K] identity matrix: Q8_0 (d = 1, q = 1) or Q4_K (d = 1, sc = 1, dmin = 0)."""
    eye = np.eye(k, dtype=np.uint8)
    if kind == "q8_0":
        scale = np.full((k, k // 32, 1), 1.0, dtype=np.float16).view(np.uint8)  # [K, B, 2]
        return torch.from_numpy(np.concatenate([scale, eye.reshape(k, k // 32, 32)], axis=2).reshape(k, -1))
    d = np.tile(np.array([1.0, 0.0], dtype=np.float16).view(np.uint8), (k, k // 256, 1))  # d, dmin
    scales = np.tile(np.array([1, 1, 1, 1, 0, 0, 0, 0, 1, 1, 1, 1], dtype=np.uint8), (k, k // 256, 1))
    q = eye.reshape(k, k // 256, 4, 2, 32)  # [K, B, pair of sub-blocks, low / high nibble, 32]
    qs = (q[:, :, :, 0] | (q[:, :, :, 1] << 4)).reshape(k, k // 256, 128)
    return torch.from_numpy(np.concatenate([d, scales, qs], axis=2).reshape(k, -1))


@pytest.mark.parametrize("kind", ["q8_0", "q4_k"])
def test_activations_are_rounded_as_llama_cpp_rounds_them(kind):
    """Through an identity matrix the product is the rounded activations themselves (q * d in
    float32): bit for bit llama.cpp's, with a zero block, a lone large value, tiny values among
    normal ones, and a NaN (which rounds to 0 and leaves its block's scale alone)."""
    k = 512
    x = torch.randn(6, k, generator=torch.Generator().manual_seed(3))
    x[1, :256] = 0.0  # a zero block (scale 0)
    x[2, 7] = 1e4  # one value sets the block's scale, the rest round to small quants
    x[3] *= 1e-30  # tiny values
    x[4] = torch.round(x[4] * 8) / 8  # ties at x * 127 / max halfway between integers, some
    x[5, 250] = float("nan")  # (an infinity makes the row NaN: its block's scale is infinite, as llama.cpp's)
    raw = identity_rows(kind, k)
    assert torch.equal(QuantizedRows(kind, raw).dequantize(), torch.eye(k))
    out = torch.ops.weft.packed_linear(x, QuantizedRows(kind, raw).pack(dot=True), None, k)
    assert torch.equal(out, rounded_activations(x, kind, np.float32))


def check_product(raw: torch.Tensor, kind: str, mins: bool, rows: int, bias: bool) -> None:
    n, k = raw.shape[0], QuantizedRows(kind, raw).shape[1]
    weight = reference_dequantize(raw, kind.upper()).double()  # [N, K]: the size of the terms
    gen = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, k, generator=gen)
    b = torch.randn(n, generator=gen) if bias else None
    panels = QuantizedRows(kind, raw).pack(dot=True, mins=mins)
    blocks = k // PANEL_BLOCK.get(kind, 32 if kind in SMALL_BLOCKS else 256)
    assert panels.dtype == torch.int8 and panels.shape == ((n + 31) // 32, blocks, BLOCK_BYTES[(kind, mins)])
    out = torch.ops.weft.packed_linear(x, panels, b, n)
    xq = rounded_activations(x, kind)
    expected = reference_product(x, raw, kind) + (0 if b is None else b.double())
    scale = (xq.abs() @ weight.abs().T).max().item() + 1e-30  # the size of the terms summed
    assert (out.double() - expected).abs().max().item() <= 2e-6 * scale


@pytest.mark.parametrize("rows", [*range(1, 14), 16, 25, 40])
@pytest.mark.parametrize("bias", [True, False])
def test_q8_0_dot_panels_compute_the_product_of_rounded_activations(rows, bias):
    check_product(random_q8_0(77, 96, seed=rows), "q8_0", False, rows, bias)  # a last panel of 13


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 6, 7, 12, 13, 25])
@pytest.mark.parametrize("kind", ["q4_0", "q5_0", "q4_1", "q5_1"])
def test_legacy_dot_panels_compute_the_product_of_rounded_activations(kind, rows):
    """Q4_0, Q5_0, Q4_1 and Q5_1 in dot panels of their own (4.5, 5.5, 5 and 6 bits a weight, as in
    the file): the product of the dequantized weights with the activations rounded as for Q8_0
    weights (Q4_1 and Q5_1's min term m * d_x * sum(x8) included), on every tile height, a last
    panel of 13 columns, and extreme scales and mins."""
    check_product(RANDOM[kind](77, 96, seed=rows), kind, False, rows, bias=rows % 2 == 0)
    check_product(RANDOM[kind](40, 64, seed=rows, extreme=True), kind, False, rows, bias=False)


@pytest.mark.parametrize("rows", [1, 2, 3, 5, 6, 7, 12, 13, 25])
@pytest.mark.parametrize(
    ("kind", "mins"),
    [("q4_k", False), ("q6_k", False), ("q5_k", False), ("q4_k", True), ("q6_k", True), ("q5_k", True)],
)
def test_k_quant_dot_panels_compute_the_product_of_rounded_activations(kind, mins, rows):
    """Q4_K, Q5_K and Q6_K, each in its own layout and in the Q6_K layout with mins (what a fusion that
    mixes them is packed in): the same product."""
    check_product(RANDOM[kind](70, 512, seed=rows), kind, mins, rows, bias=rows % 2 == 0)


def test_extreme_scales_and_activations():
    """Float16 scales from 6e-8 to 6e4 and zero, activations from 1e-30 to 1e30: no overflow in the
    int32 sums, the product as the reference computes it."""
    for rows in (1, 5):
        check_product(random_q8_0(40, 64, seed=rows, extreme=True), "q8_0", False, rows, bias=False)
        check_product(random_q4_k(40, 256, seed=rows, extreme=True), "q4_k", True, rows, bias=False)
        check_product(random_q5_k(40, 256, seed=rows, extreme=True), "q5_k", True, rows, bias=False)
        check_product(random_q5_k(40, 256, seed=rows, extreme=True), "q5_k", False, rows, bias=False)
    raw = random_q6_k(32, 256, seed=1)
    x = torch.full((2, 256), 1e30)
    x[1] = -1e-30
    out = torch.ops.weft.packed_linear(x, QuantizedRows("q6_k", raw).pack(dot=True), None, 32)
    expected = rounded_activations(x, "q6_k") @ reference_dequantize(raw, "Q6_K").double().T
    torch.testing.assert_close(out.double(), expected, rtol=1e-5, atol=0)


def largest_quants(kind: str, rows: int, k: int) -> torch.Tensor:
    """GGUF rows whose every quant is the largest its type holds (Q4_K 15 with 6-bit scales and mins
    of 63, Q6_K 63 with scales of 127, Q8_0 -128, Q4_0 and Q4_1 15, Q5_0 and Q5_1 31) and whose float16
    scales (and Q4_1 / Q5_1 mins) are 1."""
    one = np.array([1.0], dtype=np.float16).view(np.uint8)
    if kind == "q8_0":
        block = np.concatenate([one, np.full(32, 0x80, dtype=np.uint8)])
    elif kind in ("q4_0", "q5_0", "q4_1", "q5_1"):  # q 15 or 31 (every fifth bit set)
        mins = [one] if kind in ("q4_1", "q5_1") else []
        quants = np.full(16 if kind in ("q4_0", "q4_1") else 20, 0xFF, dtype=np.uint8)
        block = np.concatenate([one, *mins, quants])
    elif kind in ("q4_k", "q5_k"):  # q 15 or 31, scales and mins 63
        block = np.concatenate([one, one, np.full(140 if kind == "q4_k" else 172, 0xFF, dtype=np.uint8)])
    else:
        block = np.concatenate([np.full(192, 0xFF, dtype=np.uint8), np.full(16, 127, dtype=np.uint8), one])
    return torch.from_numpy(np.tile(block, (rows, k // (32 if kind in SMALL_BLOCKS else 256))))


@pytest.mark.parametrize(
    ("kind", "mins"),
    [
        ("q8_0", False),
        ("q4_0", False),
        ("q5_0", False),
        ("q4_1", False),
        ("q5_1", False),
        ("q4_k", False),
        ("q4_k", True),
        ("q5_k", False),
        ("q5_k", True),
        ("q6_k", False),
    ],
)
def test_the_largest_quants_times_the_largest_activations_sum_exactly(kind, mins):
    """Every quant at its type's extreme times activations that all round to +-127: the partial sums
    the byte products keep in 16 bits (vpmaddubsw pairs, added across a sub-block's groups without
    VNNI) reach their bound without saturating, on every tile height."""
    k = 512
    raw = largest_quants(kind, 40, k)
    panels = QuantizedRows(kind, raw).pack(dot=True, mins=mins)
    for rows in (1, 2, 3, 7):
        x = torch.ones(rows, k)
        x[1::2] = -1.0  # every other row all -127
        out = torch.ops.weft.packed_linear(x, panels, None, 40)
        torch.testing.assert_close(out.double(), reference_product(x, raw, kind), rtol=1e-6, atol=0)


@pytest.mark.parametrize(("kind", "mins"), list(BLOCK_BYTES))
def test_embedding_rows_from_dot_panels(kind, mins):
    """A tied table in dot panels: rows looked up exactly as the dequantization makes them."""
    k = 96 if kind in SMALL_BLOCKS else 512
    raw = RANDOM[kind](70, k, seed=5)
    weight = reference_dequantize(raw, kind.upper())
    if kind == "iq4_xs":  # its scales rounded to float16 (test_quant_types.py)
        weight = QuantizedRows(kind, raw).rewritten().dequantize()
    ids = torch.tensor([0, 31, 32, 69, 5])
    panels = QuantizedRows(kind, raw).pack(dot=True, mins=mins)
    assert torch.equal(torch.ops.weft.embedding_from_panels(ids, panels, 70, k), weight[ids])


def test_a_fusion_of_q4_k_and_q6_k_stays_quantized():
    """Q4_K_M's q/k/v with a Q6_K v: one matrix of dot panels (Q6_K layout with mins) whose product
    is each part's; parts that are not whole panels (or other kinds) fall back to float32."""
    q, v = random_q4_k(64, 256, seed=1), random_q6_k(32, 256, seed=2)
    fused = cat_rows([QuantizedRows("q4_k", q), QuantizedRows("q6_k", v)])
    assert isinstance(fused, MixedRows) and fused.shape == (96, 256) and fused.label == "q4_k+q6_k"
    x = torch.randn(3, 256, generator=torch.Generator().manual_seed(0))
    out = torch.ops.weft.packed_linear(x, fused.pack(), None, 96)
    parts = [torch.ops.weft.packed_linear(x, QuantizedRows(k, r).pack(dot=True), None, 32 * (len(r) // 32))
             for k, r in (("q4_k", q), ("q6_k", v))]  # fmt: skip
    expected = torch.cat(parts, dim=1)  # the same sums, in another float32 order (sub-blocks of 16)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5 * expected.abs().max().item())
    with pytest.raises(ValueError, match="dequantize a mixed fusion"):
        fused.pack(dot=False)
    odd = cat_rows([QuantizedRows("q4_k", q[:40]), QuantizedRows("q6_k", v)])
    assert isinstance(odd, torch.Tensor) and odd.dtype == torch.float32 and odd.shape == (72, 256)


def test_a_q5_k_m_fusion_of_q5_k_and_q6_k_stays_quantized():
    """Q5_K_M's q/k/v with a Q6_K v: one matrix in the Q6_K layout with mins, each part's product."""
    q, v = random_q5_k(64, 256, seed=3), random_q6_k(32, 256, seed=4)
    fused = cat_rows([QuantizedRows("q5_k", q), QuantizedRows("q6_k", v)])
    assert isinstance(fused, MixedRows) and fused.label == "q5_k+q6_k"
    x = torch.randn(2, 256, generator=torch.Generator().manual_seed(1))
    out = torch.ops.weft.packed_linear(x, fused.pack(), None, 96)
    weight = torch.cat([reference_dequantize(q, "Q5_K"), reference_dequantize(v, "Q6_K")]).double()
    expected = rounded_activations(x, "q5_k") @ weight.T
    scale = (rounded_activations(x, "q5_k").abs() @ weight.abs().T).max().item()
    assert (out.double() - expected).abs().max().item() <= 2e-6 * scale


def test_bad_dot_panels_are_clear_errors():
    panels = QuantizedRows("q8_0", random_q8_0(32, 64, seed=0)).pack(dot=True)
    with pytest.raises(RuntimeError, match="int8 weights must be dot panels"):
        torch.ops.weft.packed_linear(torch.randn(1, 96), panels, None, 32)
    with pytest.raises(
        RuntimeError, match="kind must be q8_0, q4_0, q5_0, q4_1, q5_1, q2_k, q3_k, q4_k, q5_k, q6_k or mxfp4"
    ):
        torch.ops.weft.pack_dot(random_q8_0(32, 64, seed=0), "iq4_nl", False)
    with pytest.raises(ValueError, match="q5_k has no exact quantized panels"):
        QuantizedRows("q5_k", random_q5_k(32, 256, seed=0)).pack(dot=False)
    with pytest.raises(RuntimeError, match="kind must be"):
        torch.ops.weft.pack_dot(random_q8_0(32, 64, seed=0), "q8_0", True)  # Q8_0 has no mins layout


def test_q5_0_and_q4_0_parts_fused_with_q8_0_ones_become_q8_0_blocks():
    """Q4_K_M of a model whose rows are not multiples of 256 gives q/k Q5_0 and v Q8_0 in some
    layers: the fusion is one Q8_0 matrix holding each part exactly; parts of one kind stay theirs."""
    q, v = random_legacy("q5_0", 64, 96, seed=1), random_q8_0(32, 96, seed=2)
    fused = cat_rows([QuantizedRows("q5_0", q), QuantizedRows("q8_0", v)])
    assert isinstance(fused, QuantizedRows) and fused.kind == "q8_0" and fused.shape == (96, 96)
    expected = torch.cat([reference_dequantize(q, "Q5_0"), reference_dequantize(v, "Q8_0")])
    assert torch.equal(fused.dequantize(), expected)
    gate, up = random_legacy("q4_0", 32, 96, seed=3), random_legacy("q4_0", 32, 96, seed=4)
    same = cat_rows([QuantizedRows("q4_0", gate), QuantizedRows("q4_0", up)])
    assert isinstance(same, QuantizedRows) and same.kind == "q4_0" and same.shape == (64, 96)
