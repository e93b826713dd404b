"""Quantizing a float checkpoint as it loads (weft/model/quantize.py, `LLM(quantization="q8_0")`):
the blocks are llama.cpp's reference Q8_0 (`gguf.quants`), and the loaded model computes what
transformers computes with every matrix replaced by its dequantized blocks."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import require_native_kernels

from weft import LLM, SamplingParams
from weft.config import ConfigError
from weft.model.quantize import quantize_rows, quantizes


@pytest.fixture(scope="module", autouse=True)
def kernels():
    require_native_kernels()


def test_q8_0_blocks_are_llama_cpp_reference_blocks():
    """Per 32 features d = float16(max |w| / 127) and q = w / d rounded half away from zero (llama.cpp's
    quantize_row_q8_0_ref, as `gguf.quants.quantize` writes it); a zero block stays zero."""
    from gguf import GGMLQuantizationType
    from gguf.quants import quantize

    gen = torch.Generator().manual_seed(0)
    w = torch.randn(40, 96, generator=gen) * 0.05
    w[1, :32] = 0.0
    s = 2.0**-6  # d = s exactly, 1 / d = 64: 2.5 * s lands halfway between two quants
    w[2, :32] = torch.tensor([127 * s, 2.5 * s, -2.5 * s, 0.5 * s] + [0.0] * 28)
    rows = quantize_rows(w, "q8_0")
    assert np.array_equal(rows.rows.numpy(), quantize(w.numpy(), GGMLQuantizationType.Q8_0))
    blocks = rows.rows.view(40, 3, 34)
    d = blocks[:, :, :2].contiguous().view(torch.float16).float()  # [40, 3, 1]
    q = blocks[:, :, 2:].contiguous().view(torch.int8)  # [40, 3, 32]
    amax = w.view(40, 3, 32).abs().amax(-1, keepdim=True)
    assert torch.equal(d, (amax / 127).half().float())
    assert q[2, 0, :4].tolist() == [127, 3, -3, 1] and not q[1, 0].any()
    error = (rows.dequantize() - w).view(40, 3, 32).abs()
    # half a step, plus d's float16 rounding (2^-11 of it) over as many as 127 steps
    assert bool((error <= d * (0.5 + 127 * 2.0**-11) + 1e-7).all())


def test_what_quantizing_at_load_takes():
    table = torch.zeros(384, 64)
    assert quantizes("model.layers.0.self_attn.q_proj.weight", table, tied=False)
    assert quantizes("lm_head.weight", table, tied=False)
    assert quantizes("model.embed_tokens.weight", table, tied=True)
    assert not quantizes("model.embed_tokens.weight", table, tied=False)  # looked up in float
    assert not quantizes("model.layers.0.input_layernorm.weight", torch.zeros(64), tied=False)
    assert not quantizes("model.layers.0.mlp.down_proj.weight", torch.zeros(64, 48), tied=False)
    for w in ("w1", "w2", "w3"):  # Mixtral's experts
        assert quantizes(f"model.layers.0.block_sparse_moe.experts.3.{w}.weight", table, tied=False)
    assert not quantizes("model.layers.0.block_sparse_moe.gate.weight", table, tied=False)  # its router


def test_a_float_checkpoint_quantized_at_load(checkpoint_factory):
    """Every matrix (the tied table too) runs from Q8_0 blocks: with exact products, the logprobs of
    transformers on the checkpoint whose matrices are replaced by their dequantized blocks, within
    1e-4; with int8 products (the default) close to those (x rounded to 8 bits: a mean |dlogp| of
    0.026 on this small random model, whose logits are large)."""
    transformers = pytest.importorskip("transformers")
    path = checkpoint_factory()
    options = {"quantization": "q8_0", "show_progress": False, "max_logprobs": 9}
    llm = LLM(str(path), **options)
    assert llm.kernels["linear"].endswith("Q8_0 for 9 matrices (int8 dot panels)"), llm.kernels
    exact = LLM(str(path), matmul_precision="float32", **options)
    assert "exact quantized panels" in exact.kernels["linear"]
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    with torch.no_grad():
        for param in hf.parameters():
            if param.dim() == 2:  # q/k/v/o, gate/up/down, the tied embedding (and so the lm_head)
                param.copy_(quantize_rows(param, "q8_0").dequantize())
        ids = [5, 17, 200, 3, 99, 250, 7, 42]
        expected = torch.log_softmax(hf(torch.tensor([ids])).logits[0].float(), dim=-1)  # [T, V]
    params = SamplingParams(max_tokens=1, prompt_logprobs=9)
    for engine, mean_bound, max_bound in ((exact, 1e-4, 1e-4), (llm, 0.04, 0.15)):
        out = engine.generate([ids], params, use_tqdm=False)[0]
        gaps = [
            abs(logprob.logprob - expected[pos - 1, token].item())
            for pos, entry in enumerate(out.prompt_logprobs[1:], start=1)
            for token, logprob in entry.items()
        ]
        assert float(np.mean(gaps)) <= mean_bound and max(gaps) <= max_bound, (np.mean(gaps), max(gaps))


def test_q4_k_blocks_are_llama_cpp_reference_blocks():
    """Q4_K (llama.cpp's quantize_row_q4_K_ref): per sub-block of 32 the 16 levels of its 6-bit scale
    and min cover the values (within one level of the dequantized value, by gguf's dequantization);
    a constant or zero super-block is exact; rows that are not whole super-blocks become Q8_0."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    gen = torch.Generator().manual_seed(1)
    w = torch.randn(24, 512, generator=gen) * 0.05
    w[1, :256] = 0.0
    w[2, :256] = 0.25
    rows = quantize_rows(w, "q4_k")
    assert rows.kind == "q4_k" and rows.rows.shape == (24, 2 * 144)
    approx = torch.from_numpy(dequantize(rows.rows.numpy(), GGMLQuantizationType.Q4_K))
    assert torch.equal(approx, rows.dequantize())
    blocks, values = approx.view(-1, 32), w.view(-1, 32)
    span = (values.amax(1) - values.amin(1).clamp(max=0)).unsqueeze(1)  # [sub-blocks, 1]
    assert bool(((blocks - values).abs() <= span / 15 + 1e-6).all())
    assert not approx[1, :256].any() and torch.allclose(approx[2, :256], w[2, :256], atol=1e-3)
    assert quantize_rows(torch.randn(4, 96), "q4_k").kind == "q8_0"


@pytest.mark.parametrize("kind", ["q8_0", "q4_k"])
def test_a_checkpoint_quantized_at_load_computes_its_dequantized_model(checkpoint_factory, kind):
    """Rows of 256 features: Q4_K for every layer matrix (the tied table Q8_0); with exact products
    the logprobs of transformers on the checkpoint whose matrices are their dequantized blocks."""
    transformers = pytest.importorskip("transformers")
    path = checkpoint_factory(
        hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2
    )
    llm = LLM(str(path), quantization=kind, matmul_precision="float32", show_progress=False, max_logprobs=9)
    expected_kinds = "Q4_K for 8 matrices, Q8_0 for 1 matrices" if kind == "q4_k" else "Q8_0 for 9 matrices"
    assert expected_kinds in llm.kernels["linear"], llm.kernels
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    with torch.no_grad():
        for name, param in hf.named_parameters():
            if param.dim() == 2:
                param.copy_(quantize_rows(param, "q8_0" if "embed" in name else kind).dequantize())
        ids = [5, 17, 200, 3, 99, 250, 7, 42]
        expected = torch.log_softmax(hf(torch.tensor([ids])).logits[0].float(), dim=-1)
    out = llm.generate([ids], SamplingParams(max_tokens=1, prompt_logprobs=9), use_tqdm=False)[0]
    for pos, entry in enumerate(out.prompt_logprobs[1:], start=1):
        for token, logprob in entry.items():
            assert abs(logprob.logprob - expected[pos - 1, token].item()) <= 1e-4


def test_bad_quantization_is_a_clear_error(checkpoint_factory):
    with pytest.raises(ConfigError, match="quantization 'q3_k' is not supported; use one of"):
        LLM(str(checkpoint_factory()), quantization="q3_k", show_progress=False)
