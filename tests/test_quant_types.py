"""The low-bit types of the files users download (Q2_K, Q3_K, IQ4_NL, IQ4_XS, MXFP4): each against
`gguf.quants.dequantize` of the same blocks. Each has dot panels of its own (Q2_K and Q3_K in the
Q6_K layout's order with 2-bit planes and a plane of third bits; IQ4_NL and IQ4_XS as Q4_0's blocks
whose nibbles are looked up as the IQ4 levels, IQ4_XS's scales rounded to float16; MXFP4's the same
nibbles under E8M0 exponents); Q2_K and Q3_K
also go into the Q6_K layout with mins for fusions; Q3_K and IQ4_NL are rewritten as Q6_K and Q8_0
blocks for exact products, bit-identical to the file's. Run on every ISA build
(tests/other_builds.py)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import require_native_kernels
from test_qdot import check_product, rounded_activations
from test_quant import (
    random_low_bit,
    random_mxfp4,
    random_q5_k,
    random_q6_k,
    random_q8_0,
    reference_dequantize,
)

from weft.model.quantized import MixedRows, QuantizedRows, cat_rows


@pytest.fixture(scope="module", autouse=True)
def kernels():
    require_native_kernels()


def rewritten(kind: str, raw: torch.Tensor) -> QuantizedRows:
    return QuantizedRows(kind, raw).rewritten()


@pytest.mark.parametrize("kind", ["q3_k", "iq4_nl"])
def test_q3_k_and_iq4_nl_are_rewritten_exactly(kind):
    """Q3_K as Q6_K and IQ4_NL as Q8_0: the same weights, bit for bit, as gguf's dequantization of
    the file's blocks, at every scale and quant."""
    raw = random_low_bit(kind, 37, 512, seed=1)
    assert torch.equal(rewritten(kind, raw).dequantize(), reference_dequantize(raw, kind.upper()))
    extreme = random_low_bit(kind, 5, 512, seed=2, scale=1000.0)
    assert torch.equal(rewritten(kind, extreme).dequantize(), reference_dequantize(extreme, kind.upper()))


def test_iq4_xs_is_rewritten_with_its_scales_rounded_to_float16():
    """IQ4_XS as IQ4_NL: each weight within 2^-11 of itself (its sub-block scale d * (ls - 32) rounded
    to a normal float16), and exactly where d * (ls - 32) is a float16 (here: d a power of two)."""
    raw = random_low_bit("iq4_xs", 37, 512, seed=3)
    expected = reference_dequantize(raw, "IQ4_XS")
    got = rewritten("iq4_xs", raw).dequantize()
    assert ((got - expected).abs() <= 2.0**-11 * expected.abs()).all()
    assert not torch.equal(got, expected)  # rounded somewhere
    blocks = raw.numpy().reshape(37, -1, 136).copy()
    blocks[..., 0:2] = np.array([2.0**-10], dtype=np.float16).view(np.uint8)
    powers = torch.from_numpy(blocks.reshape(37, -1))
    assert torch.equal(rewritten("iq4_xs", powers).dequantize(), reference_dequantize(powers, "IQ4_XS"))


@pytest.mark.parametrize("mins", [False, True])
@pytest.mark.parametrize("kind", ["q2_k", "q3_k"])
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 7, 13])
def test_q2_k_and_q3_k_dot_panels_compute_the_product_of_rounded_activations(kind, mins, rows):
    """Q2_K and Q3_K in dot panels of their own (3.1 and 3.6 bits a weight) and, as in a fusion with
    other k-quants, in the Q6_K layout with mins: the product of the dequantized weights with the
    activations rounded as llama.cpp rounds them for k-quants, on every tile height, a last panel of
    13 columns and large scales."""
    check_product(random_low_bit(kind, 77, 512, seed=rows), kind, mins, rows, bias=rows % 2 == 0)
    large = 1000.0 if not mins or kind == "q2_k" else 60.0  # Q3_K's 32 d is a float16 dmin there
    check_product(random_low_bit(kind, 40, 256, seed=rows, scale=large), kind, mins, rows, bias=False)


@pytest.mark.parametrize("kind", ["q3_k", "iq4_nl"])
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 7, 13])
def test_q3_k_and_iq4_nl_multiply_as_the_files_weights(kind, rows):
    """Q3_K and IQ4_NL in dot panels of their own (IQ4_NL in Q8_0's where the input features are not
    whole blocks of 128; exact panels as Q6_K's and Q8_0's): the product of the file's own weights
    with the activations rounded as llama.cpp rounds them for each type, on every tile height."""
    raw = random_low_bit(kind, 45, 512, seed=rows)
    check_product(raw, kind, False, rows, bias=True)
    if kind == "iq4_nl":  # 96 features: Q8_0's dot panels
        odd = random_low_bit(kind, 45, 96, seed=rows)
        panels = QuantizedRows(kind, odd).pack(dot=True)
        assert panels.shape == (2, 3, 1088)
        x = torch.randn(rows, 96, generator=torch.Generator().manual_seed(rows))
        weight = reference_dequantize(odd, "IQ4_NL").double()
        xq = rounded_activations(x, kind)
        scale = (xq.abs() @ weight.abs().T).max().item()
        out = torch.ops.weft.packed_linear(x, panels, None, 45).double()
        assert (out - xq @ weight.T).abs().max().item() <= 2e-6 * scale
    x = torch.randn(rows, 512, generator=torch.Generator().manual_seed(rows))
    exact = torch.ops.weft.packed_linear(x, QuantizedRows(kind, raw).pack(), None, 45)
    torch.testing.assert_close(exact, x @ reference_dequantize(raw, kind.upper()).T, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 7, 13])
def test_iq4_xs_multiplies_with_k_quant_activations(rows):
    """IQ4_XS in IQ4_NL's dot blocks 8 to a super-block: the activations rounded in blocks of 256
    (llama.cpp multiplies IQ4_XS with Q8_K activations), times the weights with their scales in
    float16."""
    raw = random_low_bit("iq4_xs", 45, 512, seed=rows)
    panels = QuantizedRows("iq4_xs", raw).pack(dot=True)
    assert panels.shape == (2, 2, 4608)
    x = torch.randn(rows, 512, generator=torch.Generator().manual_seed(rows))
    out = torch.ops.weft.packed_linear(x, panels, None, 45).double()
    weight = rewritten("iq4_xs", raw).dequantize().double()
    xq = rounded_activations(x, "q4_k")
    scale = (xq.abs() @ weight.abs().T).max().item()
    assert (out - xq @ weight.T).abs().max().item() <= 2e-6 * scale
    with pytest.raises(ValueError, match="iq4_xs has no exact quantized panels"):
        QuantizedRows("iq4_xs", raw).pack()


def test_a_q3_k_m_fusion_of_q3_k_and_q4_k_parts_stays_quantized():
    """Q3_K_M's q/k/v: Q3_K q and k (as Q6_K) with a Q4_K or Q5_K v, and Q2_K's with Q3_K and Q6_K
    parts, are one matrix in the Q6_K layout with mins, each part's own product."""
    q, k = (
        QuantizedRows("q3_k", random_low_bit("q3_k", 64, 256, seed=4)),
        QuantizedRows("q6_k", random_q6_k(32, 256, seed=5)),
    )
    two = QuantizedRows("q2_k", random_low_bit("q2_k", 32, 256, seed=6))
    fused = cat_rows([q, k, two])
    assert isinstance(fused, MixedRows) and fused.label == "q3_k+q6_k+q2_k"
    x = torch.randn(3, 256, generator=torch.Generator().manual_seed(0))
    out = torch.ops.weft.packed_linear(x, fused.pack(), None, 128)
    parts = [
        torch.ops.weft.packed_linear(x, p.pack(dot=True, mins=True), None, p.shape[0]) for p in fused.parts
    ]
    torch.testing.assert_close(out, torch.cat(parts, dim=1), rtol=0, atol=0)
    assert torch.allclose(fused.dequantize(), torch.cat([q.dequantize(), k.dequantize(), two.dequantize()]))


def test_iq4_nl_joins_q8_0_parts_exactly():
    """An IQ4_NL q/k with a Q8_0 v (llama.cpp's fallback where rows are not whole super-blocks): one
    Q8_0 matrix, the same weights."""
    a, b = random_low_bit("iq4_nl", 32, 64, seed=7), random_q8_0(32, 64, seed=8)
    fused = cat_rows([QuantizedRows("iq4_nl", a), QuantizedRows("q8_0", b)])
    assert isinstance(fused, QuantizedRows) and fused.kind == "q8_0"
    expected = torch.cat([reference_dequantize(a, "IQ4_NL"), reference_dequantize(b, "Q8_0")])
    assert torch.equal(fused.dequantize(), expected)


def test_bad_rows_are_refused_with_the_layout_they_need():
    with pytest.raises(
        RuntimeError, match=r"rewrite_blocks: expected a GGUF tensor's rows as uint8 \[N, K / block \* 110\]"
    ):
        torch.ops.weft.rewrite_blocks(torch.zeros(2, 100, dtype=torch.uint8), "q3_k")
    with pytest.raises(RuntimeError, match="kind must be q3_k, iq4_nl, iq4_xs or mxfp4, not q4_k"):
        torch.ops.weft.rewrite_blocks(torch.zeros(2, 144, dtype=torch.uint8), "q4_k")
    with pytest.raises(ValueError, match="q2_k has no exact quantized panels"):
        QuantizedRows("q2_k", random_low_bit("q2_k", 32, 256, seed=0)).pack(dot=False)


def test_a_fusion_no_one_layout_holds_runs_in_parts():
    """IQ4_XS q and k with a Q5_K v (llama.cpp's attn_v where 4 or more query heads share a KV
    head): one Linear whose panels are in two layouts, each part's product in its columns (not a
    float32 copy of the whole matrix); exact products dequantize it."""
    from weft.model.layers import Linear
    from weft.model.quantized import PartedRows

    q, k = random_low_bit("iq4_xs", 64, 512, seed=9), random_low_bit("iq4_xs", 32, 512, seed=10)
    v = random_q5_k(32, 512, seed=11)
    fused = cat_rows([QuantizedRows("iq4_xs", q), QuantizedRows("iq4_xs", k), QuantizedRows("q5_k", v)])
    assert isinstance(fused, PartedRows) and fused.label == "iq4_xs+q5_k" and fused.shape == (128, 512)
    assert [p.shape[0] for p in fused.parts] == [96, 32]  # q and k as one IQ4_XS matrix
    flat, parts = fused.pack()
    linear = Linear(512, 128, bias=True)
    linear.expect_parts(parts, flat.numel(), fused.label)
    linear.weight = torch.nn.Parameter(flat, requires_grad=False)  # (expect_parts: a meta placeholder)
    linear.bias.data = torch.randn(128, generator=torch.Generator().manual_seed(1))
    x = torch.randn(5, 512, generator=torch.Generator().manual_seed(2))
    expected = torch.cat(
        [torch.ops.weft.packed_linear(x, p.pack(dot=True), None, p.shape[0]) for p in fused.parts], dim=1
    )
    torch.testing.assert_close(linear(x), expected + linear.bias, rtol=0, atol=1e-6)
    reference = torch.cat(
        [
            reference_dequantize(q, "IQ4_XS"),
            reference_dequantize(k, "IQ4_XS"),
            reference_dequantize(v, "Q5_K"),
        ]
    )
    assert torch.equal(fused.dequantize(), reference)


def test_mxfp4_blocks_are_rewritten_as_the_numpy_rewrite_does():
    """The native MXFP4 -> Q5_0 rewrite of gpt-oss's experts is weft/model/mxfp4.py's, bit for bit:
    every code, and scales from 2^-128 (zero in float16) through float16's subnormals up to 2^15."""
    from weft.model.mxfp4 import mxfp4_as_q5_0

    require_native_kernels()
    rng = np.random.default_rng(0)
    blocks = rng.integers(0, 256, size=(64, 40, 17), dtype=np.uint8)
    blocks[..., 0] = rng.integers(0, 144, size=(64, 40))  # e - 128 from -128 to 15
    rows = blocks.reshape(64, -1)
    native = torch.ops.weft.rewrite_blocks(torch.from_numpy(rows), "mxfp4")
    assert np.array_equal(native.numpy(), mxfp4_as_q5_0(rows))
    blocks[0, 0, 0] = 144
    with pytest.raises(RuntimeError, match="above 2\\^15"):
        torch.ops.weft.rewrite_blocks(torch.from_numpy(blocks.reshape(64, -1)), "mxfp4")


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 7, 13])
def test_mxfp4_multiplies_from_its_own_dot_panels(rows):
    """MXFP4 (gpt-oss's experts) in dot panels of its own, 4.25 bits a weight as in the file: the
    product of the file's weights with the activations rounded for Q8_0 weights (llama.cpp
    multiplies MXFP4 with Q8_0 activations), on every tile height, a last panel of 13 columns, odd
    numbers of blocks (every other one off a cache line) and exponents from 2^-108 to 2^32; exact
    products from Q8_0's exact panels (MXFP4 rewritten as Q5_0)."""
    check_product(random_mxfp4(45, 96, seed=rows), "mxfp4", False, rows, bias=rows % 2 == 1)
    check_product(random_mxfp4(40, 160, seed=rows, extreme=True), "mxfp4", False, rows, bias=False)
    raw = random_mxfp4(45, 96, seed=rows)
    assert QuantizedRows("mxfp4", raw).pack(dot=True).shape == (2, 3, 544)
    x = torch.randn(rows, 96, generator=torch.Generator().manual_seed(rows))
    exact = torch.ops.weft.packed_linear(x, QuantizedRows("mxfp4", raw).pack(), None, 45)
    torch.testing.assert_close(exact, x @ reference_dequantize(raw, "MXFP4").T, rtol=1e-5, atol=1e-5)


def test_mxfp4_rows_are_looked_up_exactly_at_every_exponent():
    """Rows of MXFP4 dot panels (an expert's row, a table) are gguf's dequantization bit for bit, at
    every exponent: 2^-128 and 2^-127 (float32 subnormals) up to 2^127."""
    raw = random_mxfp4(64, 1024, seed=1).numpy().reshape(64, 32, 17)
    raw[..., 0] = (np.arange(64 * 32) % 256).reshape(64, 32)  # every exponent, 8 times
    rows = torch.from_numpy(raw.reshape(64, -1).copy())
    looked_up = torch.ops.weft.embedding_from_panels(
        torch.arange(64), QuantizedRows("mxfp4", rows).pack(dot=True), 64, 1024
    )
    with np.errstate(over="ignore"):  # 12 * 2^127 is inf, there as here
        assert torch.equal(looked_up, reference_dequantize(rows, "MXFP4"))


def test_mxfp4_experts_run_grouped_as_one_by_one():
    """packed_linear_rows over MXFP4 experts (a routed row each, one parallel region) is the product
    of each row with its own expert's panels, bit for bit."""
    experts = [QuantizedRows("mxfp4", random_mxfp4(70, 160, seed=e)).pack(dot=True) for e in range(4)]
    x = torch.randn(4, 160, generator=torch.Generator().manual_seed(0))
    grouped = torch.ops.weft.packed_linear_rows(x, experts, 70)
    one_by_one = torch.cat(
        [torch.ops.weft.packed_linear(x[e : e + 1], experts[e], None, 70) for e in range(4)]
    )
    assert torch.equal(grouped, one_by_one)
