"""Products over GGUF blocks in Triton (weft/cuda/quant.py) against the gguf package's reference
dequantization: every kind, rows that are not whole 256-feature chunks, decode-sized and
prefill-sized inputs, parts of two kinds in one output. On a CUDA GPU where there is one, else on
CPU tensors in Triton's interpreter."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize
from test_qdot import rounded_activations

from weft.bench import random_gguf
from weft.cuda import block_gemv, block_gemv_q8, split_k
from weft.cuda.quant import KINDS, dequantize_rows, quantized_linear, takes_int8_activations
from weft.kernels import GGUF_BLOCKS, BlockPart

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def random_blocks(kind: str, rows: int, features: int, seed: int) -> np.ndarray:
    """[rows, bytes] uint8: random blocks of `kind` whose float16 scales are small and finite."""
    return random_gguf.random_blocks(kind, rows, features, np.random.default_rng(seed), (0.001, 0.01))


def reference(kind: str, rows: np.ndarray) -> torch.Tensor:  # [N, K] float32
    values = dequantize(rows, GGMLQuantizationType[kind.upper()])
    return torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32))


def flat(rows: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(rows.reshape(-1).copy()).to(DEVICE)


# K-quants and IQ4_XS take whole 256-feature super-blocks; 32-wide kinds also 576 (18 blocks: a
# partial chunk)
SHAPES = [(kind, k) for kind in KINDS for k in ((256, 512) if GGUF_BLOCKS[kind][0] == 256 else (576, 256))]
SHAPES = [
    (kind, k) for kind, k in SHAPES if kind not in ("q4_1", "q5_1") or k == 576
]  # one size: read as Q4_0 and Q5_0 are


@pytest.mark.parametrize(("kind", "features"), SHAPES)
def test_dequantized_rows_are_ggufs(kind, features):
    rows = random_blocks(kind, 20, features, seed=features)
    parts = (BlockPart(kind, 0, 20, 0, rows.shape[1]),)
    ids = torch.tensor([3, 0, 19, 3], device=DEVICE)
    got = dequantize_rows(flat(rows), parts, ids, torch.float32).cpu()
    torch.testing.assert_close(got, reference(kind, rows)[ids.cpu()], rtol=0, atol=0)


@pytest.mark.parametrize("num_rows", [1, 3, 20])
@pytest.mark.parametrize(("kind", "features"), SHAPES)
def test_products_over_blocks_are_the_dequantized_products(kind, features, num_rows):
    """Decode-sized inputs take float32 products and sums, larger ones `tl.dot` (exact float32 for
    float32 activations); both equal x @ W.T of the reference dequantization."""
    rows = random_blocks(kind, 37, features, seed=num_rows)  # 37: a partial column tile
    x = torch.randn(num_rows, features, generator=torch.Generator().manual_seed(1))
    parts = (BlockPart(kind, 0, 37, 0, rows.shape[1]),)
    got = quantized_linear(x.to(DEVICE), flat(rows), parts, 37).cpu()
    expected = x @ reference(kind, rows).T
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5 * expected.abs().max().item())


@pytest.mark.parametrize("num_rows", [1, 4])
@pytest.mark.parametrize(
    ("kind", "features"), [("q4_k", 768), ("q5_k", 768), ("q6_k", 768), ("q8_0", 800), ("q4_0", 800)]
)
def test_decode_rows_met_as_int8_are_the_rounded_activations_products(kind, features, num_rows, monkeypatch):
    """`block_gemv_q8`: the activations rounded as llama.cpp's quantize_row_q8_K (K-quants) or
    quantize_row_q8_0 (Q8_0, Q4_0; 800 features: a last chunk of 1 block) round them, as weft's CPU
    kernels do, a NaN to 0 and a chunk of zeros to zeros, times the dequantized weights."""
    monkeypatch.setenv("WEFT_GEMV_ACTIVATIONS", "int8")
    rows = random_blocks(kind, 37, features, seed=num_rows)
    x = torch.randn(num_rows, features, generator=torch.Generator().manual_seed(2))
    x[0, 3] = float("nan")
    x[-1, 256:512] = 0.0
    parts = (BlockPart(kind, 0, 37, 0, rows.shape[1]),)
    got = quantized_linear(x.to(DEVICE), flat(rows), parts, 37).cpu().double()
    expected = rounded_activations(x, kind) @ reference(kind, rows).double().T
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5 * expected.abs().max().item())
    unrounded = x.nan_to_num().double() @ reference(kind, rows).double().T
    assert (got - unrounded).abs().max() > 1e-3 * unrounded.abs().max()  # the rounding did happen


SPLIT_CASES = [("int8", "q4_k"), ("int8", "q5_k"), ("int8", "q6_k"), ("int8", "q8_0"), ("int8", "q4_0")]
SPLIT_CASES += [("float", "q2_k"), ("float", "q8_0"), ("float", "q5_1")]


@pytest.mark.parametrize(("gemv", "kind"), SPLIT_CASES)
def test_split_tiles_add_up_and_leave_the_workspace_zero(gemv, kind):
    """Split-K (`split_k`): 3 programs a column tile, uneven shares of 7 chunks (or 18 blocks), the
    same products as one program, and the workspace all zeros again after every launch."""
    features = 1792 if kind.endswith("_k") else 576
    rows = random_blocks(kind, 37, features, seed=9)
    x = torch.randn(3, features, generator=torch.Generator().manual_seed(10)).to(DEVICE)
    run = block_gemv_q8.gemv_q8 if gemv == "int8" else block_gemv.gemv
    outs = []
    for split in (1, 3):
        out = torch.full((3, 40), 7.0, device=DEVICE)
        run(x, flat(rows), kind, 37, rows.shape[1], out[:, 1:], split=split)
        outs.append(out.cpu())
        sums, counts = split_k.workspace(x.device, 1, 1, 1)
        assert not sums.any() and not counts.any()
    assert (outs[1][:, 0] == 7).all() and (outs[1][:, 38:] == 7).all()
    torch.testing.assert_close(outs[1], outs[0], rtol=1e-5, atol=1e-5 * outs[0].abs().max().item())


def test_half_precision_decode_rows_take_int8_where_the_kernel_has_the_kind(monkeypatch):
    monkeypatch.delenv("WEFT_GEMV_ACTIVATIONS", raising=False)
    assert takes_int8_activations("q4_k", torch.bfloat16) and takes_int8_activations("q6_k", torch.float16)
    assert not takes_int8_activations("q4_k", torch.float32)
    assert takes_int8_activations("q8_0", torch.bfloat16) and takes_int8_activations("q4_0", torch.bfloat16)
    assert not takes_int8_activations("q5_0", torch.bfloat16) and not takes_int8_activations(
        "q4_1", torch.float16
    )
    monkeypatch.setenv("WEFT_GEMV_ACTIVATIONS", "float")
    assert not takes_int8_activations("q4_k", torch.bfloat16)
    monkeypatch.setenv("WEFT_GEMV_ACTIVATIONS", "fp8")
    with pytest.raises(ValueError, match="WEFT_GEMV_ACTIVATIONS='fp8': choose float or int8"):
        takes_int8_activations("q4_k", torch.bfloat16)
    monkeypatch.delenv("WEFT_GEMV_ACTIVATIONS")
    rows = random_blocks("q6_k", 16, 512, seed=7)
    x = torch.randn(2, 512, generator=torch.Generator().manual_seed(8)).bfloat16()
    parts = (BlockPart("q6_k", 0, 16, 0, rows.shape[1]),)
    got = quantized_linear(x.to(DEVICE), flat(rows), parts, 16).cpu().double()
    expected = rounded_activations(x.float(), "q6_k") @ reference("q6_k", rows).double().T
    # within bfloat16's rounding of the output
    torch.testing.assert_close(got, expected, rtol=8e-3, atol=8e-3 * expected.abs().max().item())


def test_parts_of_two_kinds_write_their_own_columns():
    """A fused matrix of Q4_K then Q6_K rows (Q4_K_M's q|k|v), with a bias."""
    q4, q6 = random_blocks("q4_k", 32, 512, seed=1), random_blocks("q6_k", 16, 512, seed=2)
    weight = torch.cat([flat(q4), flat(q6)])
    parts = (BlockPart("q4_k", 0, 32, 0, q4.shape[1]), BlockPart("q6_k", 32, 16, q4.size, q6.shape[1]))
    x = torch.randn(2, 512, generator=torch.Generator().manual_seed(3))
    bias = torch.randn(48, generator=torch.Generator().manual_seed(4))
    got = quantized_linear(x.to(DEVICE), weight, parts, 48, bias.to(DEVICE)).cpu()
    expected = x @ torch.cat([reference("q4_k", q4), reference("q6_k", q6)]).T + bias
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-4)


def test_bfloat16_activations_round_only_the_tile():
    """Half-precision activations: within bfloat16's rounding of the exact product."""
    rows = random_blocks("q4_k", 64, 512, seed=5)
    x = torch.randn(24, 512, generator=torch.Generator().manual_seed(6)).bfloat16()
    parts = (BlockPart("q4_k", 0, 64, 0, rows.shape[1]),)
    got = quantized_linear(x.to(DEVICE), flat(rows), parts, 64).cpu().float()
    expected = x.float() @ reference("q4_k", rows).T
    torch.testing.assert_close(got, expected, rtol=2e-2, atol=2e-2 * expected.abs().max().item())


def test_kinds_the_kernels_lack_run_rewritten_where_exact():
    """On a kernel set that multiplies blocks (CUDA's), MXFP4 experts and Q3_K and IQ4_NL matrices
    are kept as the Q5_0, Q6_K and Q8_0 blocks of the same weights (exactly), not dequantized;
    IQ4_XS is multiplied as it is."""
    from types import SimpleNamespace

    from torch import nn

    from weft.model.layers import Linear
    from weft.model.loader import _expect_blocks
    from weft.model.quantized import QuantizedRows

    gen = np.random.default_rng(0)
    matrices = {
        "mxfp4": random_gguf.random_mxfp4(40, 256, gen),
        "q3_k": random_gguf.random_blocks("q3_k", 40, 256, gen, (0.001, 0.01)),
        "iq4_nl": random_gguf.random_blocks("iq4_nl", 40, 256, gen, (0.001, 0.01)),
        "iq4_xs": random_gguf.random_blocks("iq4_xs", 40, 256, gen, (0.001, 0.01)),
    }
    with torch.device("meta"):
        model = nn.ModuleDict({kind: Linear(256, 40, bias=False) for kind in matrices})
    kernels = SimpleNamespace(block_kinds=frozenset(KINDS))
    state = (
        (f"{kind}.weight", QuantizedRows(kind, torch.from_numpy(rows))) for kind, rows in matrices.items()
    )
    tensors = _expect_blocks(model, state, kernels)  # type: ignore[arg-type]
    labels = {kind: model[kind].quantized for kind in matrices}
    assert labels == {"mxfp4": "q5_0", "q3_k": "q6_k", "iq4_nl": "q8_0", "iq4_xs": "iq4_xs"}
    x = torch.randn(3, 256, generator=torch.Generator().manual_seed(5))
    for kind in matrices:
        got = quantized_linear(
            x.to(DEVICE), tensors[f"{kind}.weight"].to(DEVICE), model[kind].blocks.parts, 40
        )
        expected = x @ reference(kind, matrices[kind]).T
        torch.testing.assert_close(got.cpu(), expected, rtol=1e-5, atol=1e-5 * expected.abs().max().item())
