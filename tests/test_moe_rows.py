"""A row alone (batch 1) takes its routed experts in two grouped products (`packed_linear_rows`,
weft/model/moe.py): the same numbers as the expert-by-expert loop."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import require_native_kernels

from weft import LLM, SamplingParams
from weft.bench.random_gguf import random_blocks
from weft.model import moe
from weft.model.moe import SparseMoE
from weft.model.quantized import QuantizedRows

SHAPES = [("q4_k", 96, 512), ("q6_k", 64, 256), ("q8_0", 70, 96), ("q5_0", 40, 64)]


def _panels(kind: str, rows: int, k: int, count: int, rng: np.random.Generator) -> list[torch.Tensor]:
    blocks = [torch.from_numpy(random_blocks(kind, rows, k, rng)) for _ in range(count)]
    return [QuantizedRows(kind, b).pack(dot=True) for b in blocks]


@pytest.mark.parametrize(("kind", "rows", "k"), SHAPES)
def test_packed_linear_rows_is_packed_linear_row_by_row(kind, rows, k):
    require_native_kernels()
    panels = _panels(kind, rows, k, 5, np.random.default_rng(0))
    x = torch.randn(5, k, generator=torch.Generator().manual_seed(1))
    for rows_in in (x, x[:1].expand(5, k)):  # a row each, or one row for every matrix (gate|up)
        want = [torch.ops.weft.packed_linear(rows_in[e : e + 1], panels[e], None, rows) for e in range(5)]
        assert torch.equal(torch.ops.weft.packed_linear_rows(rows_in, panels, rows), torch.cat(want))


def test_packed_linear_rows_refuses_what_it_cannot_multiply():
    require_native_kernels()
    rng = np.random.default_rng(0)
    (q4k,), (q8,) = _panels("q4_k", 64, 256, 1, rng), _panels("q8_0", 64, 256, 1, rng)
    with pytest.raises(RuntimeError, match="one row for each"):
        torch.ops.weft.packed_linear_rows(torch.randn(3, 256), [q4k, q4k], 64)
    with pytest.raises(RuntimeError, match="one shape and kind"):
        torch.ops.weft.packed_linear_rows(torch.randn(2, 256), [q4k, q8], 64)


FILES = [("qwen3moe", "q8_0"), ("gptoss", "mxfp4")]


@pytest.fixture(scope="module", params=FILES, ids=[arch for arch, _ in FILES])
def moe_llm(request, checkpoint_factory, tmp_path_factory) -> LLM:
    """Random files of two layers: Qwen3-MoE's experts in Q8_0; gpt-oss's in MXFP4 (dot panels of its own),
    with biases and its clamped SwiGLU."""
    from weft.bench.random_gguf import word_level_tokenizer, write_random_gguf

    arch, mix = request.param
    out = tmp_path_factory.mktemp(f"moe-rows-{arch}")
    config = checkpoint_factory(arch) / "config.json"
    path = write_random_gguf(Path(config), mix, out / "random.gguf", num_layers=2)
    return LLM(str(path), tokenizer=str(word_level_tokenizer(384, out / "tokenizer")), show_progress=False)


def test_a_row_alone_takes_its_experts_in_two_products_with_the_loops_numbers(moe_llm, monkeypatch):
    require_native_kernels()
    layers = [m for m in moe_llm.engine.model.modules() if isinstance(m, SparseMoE)]
    assert layers and all(layer._groups() for layer in layers)
    params = SamplingParams(max_tokens=12, temperature=0, logprobs=3, ignore_eos=True)

    def records(llm: LLM) -> list:
        (out,) = llm.generate([[5, 6, 7, 8]], params)
        return [out.outputs[0].token_ids, [sorted(d.items()) for d in out.outputs[0].logprobs]]

    grouped = records(moe_llm)
    monkeypatch.setattr(SparseMoE, "_groups", lambda self: False)
    assert records(moe_llm) == grouped


def test_a_long_prefill_takes_its_experts_in_chunks_with_the_same_numbers(moe_llm, monkeypatch):
    """A prefill longer than `MOE_CHUNK_BYTES` allows routes its rows a chunk at a time (bounding the
    [T * k, hidden] buffers of a 2,048-token step): each row's output is the one it gets unchunked,
    bit for bit, the last chunk short."""
    require_native_kernels()
    layer = next(m for m in moe_llm.engine.model.modules() if isinstance(m, SparseMoE))
    x = torch.randn(45, layer.router.in_features, generator=torch.Generator().manual_seed(0))
    whole = layer(x)
    monkeypatch.setattr(moe, "MOE_CHUNK_BYTES", 2 * 4 * layer.top_k * x.shape[1] * 8)  # 8 rows a chunk
    assert torch.equal(layer(x), whole)
