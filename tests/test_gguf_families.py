"""GGUF files of other families, made by llama.cpp's own converter (../shared/data/gguf-families):
weft reads each file's configuration and computes what llama.cpp computed on it (its greedy tokens
and teacher-forced logprobs, recorded in the folder's `llama_cpp_reference.json`)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from weft import LLM, SamplingParams

FAMILIES_DIR = Path(__file__).resolve().parents[2] / "shared" / "data" / "gguf-families"
REFERENCE = FAMILIES_DIR / "llama_cpp_reference.json"

pytestmark = pytest.mark.skipif(
    not REFERENCE.is_file(), reason="../shared/data/gguf-families is not here (a user's clone)"
)


@pytest.fixture(scope="module")
def reference() -> dict:
    return json.loads(REFERENCE.read_text())


# file -> what its configuration must say (the family's settings, read from the GGUF metadata)
FILES = {
    "granite-f16": lambda c: (
        (c.embedding_multiplier, c.logits_scaling, c.attention_multiplier) == (12.0, 8.0, 2**-7)
        and c.residual_multiplier == pytest.approx(0.22)
    ),  # float32 in the file
    "smollm3-f16": lambda c: c.rope_layers == (True, True, True, False),
    "qwen3yarn-f16": lambda c: (
        (c.rope.rope_type, c.rope.factor, c.rope.original_max_position_embeddings) == ("yarn", 4.0, 64)
    ),
    # llama.cpp's Gemma 3: every 6th layer global (so all four of these slide), windows of 32
    "gemma3-f16": lambda c: (
        (c.sliding_window, c.sliding_layers, c.hidden_act) == (32, (True,) * 4, "gelu_pytorch_tanh")
        and (c.rope.theta, c.sliding_rope.theta, c.embedding_multiplier) == (1e6, 1e4, 8.0)
    ),
    # mixtures of 8 experts, 2 per token, weights normalised: Qwen3-MoE (f16, and Q4_K_M, whose
    # experts run from their blocks), Mixtral (llama.cpp's llama with experts)
    "qwen3moe-f16": lambda c: (c.num_experts, c.experts_per_token, c.moe_intermediate_size) == (8, 2, 32),
    "mixtral-f16": lambda c: c.architecture == "MixtralForCausalLM" and c.moe_intermediate_size == 128,
    # gpt-oss: 4 experts with biases and clamped SwiGLU, attention sinks, every other layer sliding,
    # YaRN (factor 32 over 64 positions)
    "gptoss-f16": lambda c: (
        c.attention_sinks
        and c.swiglu_limit == 7.0
        and c.sliding_layers == (True, False, True, False)
        and (c.rope.rope_type, c.rope.factor) == ("yarn", 32.0)
    ),
}


# llama.cpp's own distance from exact float32 arithmetic on a file, where it is above 0.001: transformers
# reading gemma3-f16.gguf (dequantized exactly, its query_pre_attn_scalar set to the head size as
# llama.cpp's) is 0.0016 from llama.cpp on average (0.0039 at most) and 1.6e-6 from weft.
MEAN_GAP = {"gemma3-f16": 0.002, "mixtral-f16": 0.002}
# One of the five long prompts meets a near-tie of Mixtral's router (its 2nd and 3rd experts 7.6e-7
# apart in probability, in float32): llama.cpp's float16 products pick the other expert there, and
# that prompt's logprobs move by up to 0.031 from then on (the other prompts' gaps stay under 0.002).
MAX_GAP = {"mixtral-f16": 0.05}


def _gaps(llm: LLM, name: str, reference: dict) -> list[float]:
    """|weft's logprob - llama.cpp's| of each of llama.cpp's greedy tokens, teacher-forced."""
    runs, prompts, gaps = reference["files"][name], reference["prompts"], []
    forced = llm.generate(
        [p + run["tokens"] for p, run in zip(prompts, runs, strict=True)],
        SamplingParams(max_tokens=1, prompt_logprobs=1),
        use_tqdm=False,
    )
    for prompt, run, out in zip(prompts, runs, forced, strict=True):
        steps = out.prompt_logprobs[len(prompt) :]
        gaps += [
            abs(e[t].logprob - lp) for t, e, lp in zip(run["tokens"], steps, run["tf_logprobs"], strict=True)
        ]
    return gaps


@pytest.mark.parametrize("name", ["qwen3moe-q4_k_m", "gptoss-q8_0"])
def test_quantized_experts_are_as_close_to_llama_cpp_as_exact_dequantization(reference, name):
    """Qwen3-MoE in Q4_K_M (llama.cpp's mix of Q5_0, Q5_1 and Q8_0 at this size) and gpt-oss in
    Q8_0, experts in their blocks: weft's int8-activation products are about as close to
    llama.cpp's logprobs as the exact float32 products of the dequantized file (measured 0.0103
    against 0.0095 on average, and 0.0057 against 0.0089)."""
    path = str(FAMILIES_DIR / f"{name}.gguf")
    fast = LLM(path, show_progress=False, max_logprobs=5)
    assert "int8 dot panels" in fast.kernels["linear"]
    exact = LLM(path, show_progress=False, max_logprobs=5, matmul_precision="float32")
    fast_gap, exact_gap = (float(np.mean(_gaps(llm, name, reference))) for llm in (fast, exact))
    assert exact_gap <= 0.015 and fast_gap <= 1.2 * exact_gap, (fast_gap, exact_gap)


@pytest.mark.parametrize("name", list(FILES))
def test_a_family_computes_what_llama_cpp_computes(name, reference):
    """Teacher-forced along llama.cpp's 16 greedy tokens after each of the six prompts (five of 80
    tokens, past SmolLM3's NoPE layer and YaRN's original 64 positions), weft's logprob of each
    token is within 0.005 of llama.cpp's (mean within 0.001, or `MEAN_GAP`), and its greedy tokens
    are llama.cpp's."""
    llm = LLM(str(FAMILIES_DIR / f"{name}.gguf"), show_progress=False, max_logprobs=5)
    assert FILES[name](llm.config.model), llm.config.model
    gaps = _gaps(llm, name, reference)
    runs, prompts = reference["files"][name], reference["prompts"]
    mean_gap = MEAN_GAP.get(name, 0.001)
    max_gap = MAX_GAP.get(name, 0.005)
    assert max(gaps) <= max_gap and float(np.mean(gaps)) <= mean_gap, (max(gaps), np.mean(gaps))
    greedy = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    outs = llm.generate(prompts, greedy, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [run["tokens"] for run in runs]


@pytest.fixture(scope="module")
def gptoss_mxfp4(tmp_path_factory) -> Path:
    """gptoss-f16.gguf with its experts in MXFP4 (gguf's quantizer), as the published gpt-oss files
    hold them; every other tensor and key as they are."""
    import gguf
    from gguf.quants import quantize

    from weft.model.gguf_checkpoint import GgufCheckpoint
    from weft.model.gguf_quantize import _copy_field

    source = GgufCheckpoint(FAMILIES_DIR / "gptoss-f16.gguf")
    out = tmp_path_factory.mktemp("mxfp4") / "gptoss-mxfp4.gguf"
    writer = gguf.GGUFWriter(str(out), source.arch)
    for key, field in source.reader.fields.items():
        if key != "general.architecture":
            _copy_field(writer, key, field)
    for tensor in source.reader.tensors:
        if "_exps.weight" in tensor.name:
            values = source.dequantized(tensor).numpy()
            writer.add_tensor(tensor.name, quantize(values, gguf.GGMLQuantizationType.MXFP4),
                              raw_dtype=gguf.GGMLQuantizationType.MXFP4)  # fmt: skip
        else:
            writer.add_tensor(tensor.name, np.asarray(tensor.data), raw_dtype=tensor.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


def test_mxfp4_experts_run_from_their_blocks_exactly(gptoss_mxfp4, reference):
    """MXFP4 experts stay in their blocks (views of the file, gguf's dequantization of them bit for
    bit) and run through dot panels of their own, whose logprobs along llama.cpp's tokens stay
    within int8 activations' rounding of the exact float32 products of the same weights."""
    from gguf.quants import dequantize

    from weft.model.gguf_checkpoint import GgufCheckpoint

    checkpoint = GgufCheckpoint(gptoss_mxfp4)
    tensor = next(t for t in checkpoint.reader.tensors if t.name == "blk.0.ffn_up_exps.weight")
    experts = dict(checkpoint._experts(tensor, 0, "up_proj.weight", keep_blocks=True))
    rows = experts["model.layers.0.mlp.experts.1.up_proj.weight"]
    exact = dequantize(np.asarray(tensor.data), tensor.tensor_type)[1]  # [out, in]
    assert rows.kind == "mxfp4" and rows.shape == exact.shape
    assert np.array_equal(rows.dequantize().numpy(), exact)
    fast = LLM(str(gptoss_mxfp4), show_progress=False, max_logprobs=5)
    assert "MXFP4 for 32 matrices (int8 dot panels)" in fast.kernels["linear"], fast.kernels["linear"]
    exact_llm = LLM(str(gptoss_mxfp4), show_progress=False, max_logprobs=5, matmul_precision="float32")
    prompts = [
        p + run["tokens"]
        for p, run in zip(reference["prompts"], reference["files"]["gptoss-f16"], strict=True)
    ]
    forced = SamplingParams(max_tokens=1, prompt_logprobs=0)
    fast_out, exact_out = (llm.generate(prompts, forced, use_tqdm=False) for llm in (fast, exact_llm))
    gaps = [
        abs(a[t].logprob - b[t].logprob)
        for x, y, prompt in zip(fast_out, exact_out, prompts, strict=True)
        for t, a, b in zip(prompt[1:], x.prompt_logprobs[1:], y.prompt_logprobs[1:], strict=True)
    ]
    # int8 activations against exact products: measured 0.0021 on average, 0.0083 at most
    assert float(np.mean(gaps)) <= 0.005 and max(gaps) <= 0.03, (np.mean(gaps), max(gaps))
