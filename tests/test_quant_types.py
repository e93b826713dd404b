"""The low-bit types of the files users download (Q2_K, Q3_K, IQ4_NL, IQ4_XS): each against
`gguf.quants.dequantize` of the same blocks. Q3_K and IQ4_NL are rewritten as Q6_K and Q8_0 blocks
whose dequantization is bit-identical to the file's; IQ4_XS as Q8_0 blocks whose scales are rounded
to float16; Q2_K goes into the Q6_K dot layout with mins, exactly. Run on every ISA build
(tests/other_builds.py)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import require_native_kernels
from test_qdot import check_product
from test_quant import random_q6_k, reference_dequantize

from weft.model.quantized import MixedRows, QuantizedRows, cat_rows

SIZES = {"q2_k": 84, "q3_k": 110, "iq4_nl": 18, "iq4_xs": 136}
BLOCK = {"q2_k": 256, "q3_k": 256, "iq4_nl": 32, "iq4_xs": 256}
D_AT = {"q2_k": (80, 82), "q3_k": (108,), "iq4_nl": (0,), "iq4_xs": (0,)}  # float16 scales' offsets


@pytest.fixture(scope="module", autouse=True)
def kernels():
    require_native_kernels()


def random_blocks(kind: str, rows: int, in_features: int, seed: int, scale: float = 0.01) -> torch.Tensor:
    """Random rows of `kind`'s blocks, uint8 [rows, in / block * size]: random bytes (every byte
    string is a valid block) with float16 scales drawn normal(0, `scale`)."""
    gen = np.random.default_rng(seed)
    blocks, size = in_features // BLOCK[kind], SIZES[kind]
    raw = gen.integers(0, 256, (rows, blocks, size), dtype=np.uint8)
    for at in D_AT[kind]:
        d = gen.normal(0, scale, (rows, blocks, 1)).astype(np.float16)
        raw[..., at : at + 2] = d.view(np.uint8)
    return torch.from_numpy(raw.reshape(rows, -1).copy())


def rewritten(kind: str, raw: torch.Tensor) -> QuantizedRows:
    target = {"q3_k": "q6_k", "iq4_nl": "q8_0", "iq4_xs": "q8_0"}[kind]
    return QuantizedRows(target, torch.ops.weft.rewrite_blocks(raw, kind))


@pytest.mark.parametrize("kind", ["q3_k", "iq4_nl"])
def test_q3_k_and_iq4_nl_are_rewritten_exactly(kind):
    """Q3_K as Q6_K and IQ4_NL as Q8_0: the same weights, bit for bit, as gguf's dequantization of
    the file's blocks, at every scale and quant."""
    raw = random_blocks(kind, 37, 512, seed=1)
    assert torch.equal(rewritten(kind, raw).dequantize(), reference_dequantize(raw, kind.upper()))
    extreme = random_blocks(kind, 5, 512, seed=2, scale=1000.0)
    assert torch.equal(rewritten(kind, extreme).dequantize(), reference_dequantize(extreme, kind.upper()))


def test_iq4_xs_is_rewritten_with_its_scales_rounded_to_float16():
    """IQ4_XS as Q8_0: each weight within 2^-11 of itself (its sub-block scale d * (ls - 32) rounded
    to a normal float16), and exactly where d * (ls - 32) is a float16 (here: d a power of two)."""
    raw = random_blocks("iq4_xs", 37, 512, seed=3)
    expected = reference_dequantize(raw, "IQ4_XS")
    got = rewritten("iq4_xs", raw).dequantize()
    assert ((got - expected).abs() <= 2.0**-11 * expected.abs()).all()
    assert not torch.equal(got, expected)  # rounded somewhere
    blocks = raw.numpy().reshape(37, -1, 136).copy()
    blocks[..., 0:2] = np.array([2.0**-10], dtype=np.float16).view(np.uint8)
    powers = torch.from_numpy(blocks.reshape(37, -1))
    assert torch.equal(rewritten("iq4_xs", powers).dequantize(), reference_dequantize(powers, "IQ4_XS"))


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 7, 13])
def test_q2_k_dot_panels_compute_the_product_of_rounded_activations(rows):
    """Q2_K in the Q6_K dot layout with mins: the product of the dequantized weights with the
    activations rounded as llama.cpp rounds them for k-quants, on every tile height and a last panel
    of 13 columns."""
    check_product(random_blocks("q2_k", 77, 512, seed=rows), "q2_k", True, rows, bias=rows % 2 == 0)
    check_product(random_blocks("q2_k", 40, 256, seed=rows, scale=1000.0), "q2_k", True, rows, bias=False)


@pytest.mark.parametrize("kind", ["q3_k", "iq4_nl", "iq4_xs"])
@pytest.mark.parametrize("rows", [1, 5])
def test_rewritten_blocks_multiply_as_their_new_kind(kind, rows):
    """The rewritten rows in their kind's dot panels: the product of the file's weights (rewritten)."""
    matrix = rewritten(kind, random_blocks(kind, 45, 512, seed=rows))
    check_product(matrix.rows, matrix.kind, False, rows, bias=True)


def test_a_q3_k_m_fusion_of_q3_k_and_q4_k_parts_stays_quantized():
    """Q3_K_M's q/k/v: Q3_K q and k (as Q6_K) with a Q4_K or Q5_K v, and Q2_K's with Q3_K and Q6_K
    parts, are one matrix in the Q6_K layout with mins, each part's own product."""
    q, k = rewritten("q3_k", random_blocks("q3_k", 64, 256, seed=4)), QuantizedRows("q6_k", random_q6_k(32, 256, seed=5))
    two = QuantizedRows("q2_k", random_blocks("q2_k", 32, 256, seed=6))
    fused = cat_rows([q, k, two])
    assert isinstance(fused, MixedRows) and fused.label == "q6_k+q2_k"
    x = torch.randn(3, 256, generator=torch.Generator().manual_seed(0))
    out = torch.ops.weft.packed_linear(x, fused.pack(), None, 128)
    parts = [torch.ops.weft.packed_linear(x, p.pack(dot=True, mins=True), None, p.shape[0]) for p in fused.parts]
    torch.testing.assert_close(out, torch.cat(parts, dim=1), rtol=0, atol=0)
    assert torch.allclose(fused.dequantize(), torch.cat([q.dequantize(), k.dequantize(), two.dequantize()]))


def test_bad_rows_are_refused_with_the_layout_they_need():
    with pytest.raises(RuntimeError, match=r"rewrite_blocks: expected a GGUF tensor's rows as uint8 \[N, K / block \* 110\]"):
        torch.ops.weft.rewrite_blocks(torch.zeros(2, 100, dtype=torch.uint8), "q3_k")
    with pytest.raises(RuntimeError, match="kind must be q3_k, iq4_nl or iq4_xs, not q4_k"):
        torch.ops.weft.rewrite_blocks(torch.zeros(2, 144, dtype=torch.uint8), "q4_k")
    with pytest.raises(ValueError, match="q2_k has no exact quantized panels"):
        QuantizedRows("q2_k", random_blocks("q2_k", 32, 256, seed=0)).pack(dot=False)
