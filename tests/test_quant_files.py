"""Files of the low-bit types as llama.cpp's quantizer makes them (tests/data/quant_types, made by
benchmarks/make_quant_files.py: a tiny random Llama quantized by `llama_model_quantize` into Q2_K,
Q3_K_M, Q5_K_M, IQ4_NL and IQ4_XS, with llama.cpp's outputs on each): weft loads every mix of types
they hold, and its logprobs are as close to llama.cpp's as an exact float32 dequantization of the
same file gets, or closer (llama.cpp rounds the activations to 8 bits in its products, as weft's
int8 products do)."""

from __future__ import annotations

import functools
import json
from pathlib import Path

import pytest
from conftest import require_native_kernels
from llama_cpp_records import teacher_forced_gap

from weft import LLM, SamplingParams

DATA = Path(__file__).parent / "data" / "quant_types"
# nats: where weft ranks llama.cpp's token this close to its own, the two may part. Teacher-forced
# along llama.cpp's tokens, one token's |logprob difference| reaches 0.33 (IQ4_NL) to 0.65 (Q5_K_M)
# in these tiny random files (int8 products, a Zen 4), and the last bits of a float sum move from
# one CPU to another (on the Zen 4 an AVX2 build of weft ranks IQ4_NL's 7th prompt's token 0.48
# below its own, where on an AVX2 EPYC it chose it)
CLOSE = 0.5
REFERENCE = json.loads((DATA / "llama_cpp.json").read_text())
# What each file's matrices run as (llm.kernels["linear"], int8 products): the file's own types
KINDS = {
    "q2_k": "Q2_K for 2 matrices, Q2_K+Q3_K for 2 matrices, Q3_K for 4 matrices",
    "q3_k_m": "Q3_K for 2 matrices, Q3_K+Q5_K for 2 matrices, Q4_K for 4 matrices",
    "q5_k_m": "Q5_K for 6 matrices, Q5_K+Q6_K for 1 matrices",
    "iq4_nl": "IQ4_NL for 8 matrices",
    "iq4_xs": "IQ4_XS for 8 matrices",
}


@pytest.fixture(scope="module", autouse=True)
def kernels():
    require_native_kernels()


@functools.cache
def load(name: str, precision: str) -> LLM:
    path = str(DATA / f"{name}.gguf")  # placeholder tokens: the tests feed token ids
    return LLM(path, show_progress=False, max_logprobs=5, matmul_precision=precision)


@pytest.mark.parametrize("name", list(KINDS))
def test_low_bit_files_are_as_close_to_llama_cpp_as_their_exact_dequantization(name):
    """int8 products (the CPU default for quantized files) against float32 products of the exactly
    dequantized weights: at most 5% further from llama.cpp's teacher-forced logprobs, and the argmax
    agreeing as often, less three. Measured (int8 / exact): Q2_K 0.061 / 0.090, Q3_K_M 0.061 / 0.075,
    Q5_K_M 0.070 / 0.097, IQ4_NL 0.038 / 0.057, IQ4_XS 0.059 / 0.068. In these tiny random models
    the top two tokens are often close, and the last bits of a float sum (the products' block scales
    summed 16 lanes wide on AVX-512, 8 on AVX2; torch's own kernels, chosen by the CPU) become whole
    8-bit steps in the next layer's rounding: Q3_K_M agrees at 120 of 128 positions on an AVX2 EPYC,
    118 on a Zen 4 (avx512 and avx512_bf16 builds), 120 exactly dequantized."""
    int8, exact = load(name, "int8"), load(name, "float32")
    assert KINDS[name] in int8.kernels["linear"] and "int8 dot panels" in int8.kernels["linear"]
    prompts, runs = REFERENCE["prompts"], REFERENCE["files"][name]
    gap, agree, _ = teacher_forced_gap(int8, prompts, runs)
    exact_gap, exact_agree, _ = teacher_forced_gap(exact, prompts, runs)
    print(f"{name}: int8 {gap:.4f} ({agree}/128), exact {exact_gap:.4f} ({exact_agree}/128)")
    assert gap <= 1.05 * exact_gap and agree >= exact_agree - 3, (gap, agree, exact_gap, exact_agree)


@pytest.mark.parametrize("name", list(KINDS))
def test_low_bit_files_greedy_tokens_follow_llama_cpp(name):
    """Greedy generation from each prompt: llama.cpp's first token, or a token weft ranks within
    `CLOSE` nats of it (on a Zen 4, Q3_K_M's first prompt: 0.011 apart)."""
    llm = load(name, "int8")
    outs = llm.generate(
        [list(p) for p in REFERENCE["prompts"]],
        SamplingParams(max_tokens=2, temperature=0, ignore_eos=True, logprobs=5),
        use_tqdm=False,
    )
    for out, run in zip(outs, REFERENCE["files"][name], strict=True):
        ours, theirs, top = out.outputs[0].token_ids[0], run["tokens"][0], out.outputs[0].logprobs[0]
        assert ours == theirs or (theirs in top and top[ours].logprob - top[theirs].logprob <= CLOSE), (
            ours,
            theirs,
            top,
        )


@pytest.mark.parametrize("name", list(KINDS))
def test_triton_kernels_keep_every_low_bit_matrix_in_its_blocks(name, monkeypatch):
    """The Triton kernel set (CUDA; Triton's interpreter here) multiplies Q2_K, Q5_K and IQ4_XS
    blocks as the file stores them (Q3_K and IQ4_NL rewritten as Q6_K and Q8_0, exactly), no matrix
    made float, and its float32 logprobs, prompt rows (`tl.dot`) and decode rows (`block_gemv`)
    alike, are the torch kernel set's, which multiplies the same file's float32 dequantization."""
    import torch

    path, ids = str(DATA / f"{name}.gguf"), [5, 300, 17, 900, 42, 611, 77, 1000]
    params = SamplingParams(max_tokens=3, temperature=0, prompt_logprobs=3, logprobs=3, ignore_eos=True)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    outs = {}
    for kernel_set in ("torch", "triton"):
        monkeypatch.setenv("WEFT_KERNELS", kernel_set)
        llm = LLM(path, show_progress=False, device=device, dtype="float32", enforce_eager=True,
                  matmul_precision="float32")  # fmt: skip
        outs[kernel_set] = llm.generate([ids], params, use_tqdm=False)[0]
    linears = [m for m in llm.engine.model.modules() if type(m).__name__ == "Linear"]
    assert linears and all(m.weight.dtype == torch.uint8 for m in linears), llm.kernels
    torch_out, triton_out = outs["torch"], outs["triton"]
    assert triton_out.outputs[0].token_ids == torch_out.outputs[0].token_ids
    pairs = list(zip(torch_out.prompt_logprobs[1:], triton_out.prompt_logprobs[1:], strict=True))
    pairs += list(zip(torch_out.outputs[0].logprobs, triton_out.outputs[0].logprobs, strict=True))
    for expected, got in pairs:
        for token, logprob in expected.items():
            tolerance = 1e-4 + 2e-5 * abs(logprob.logprob)  # float32 sums; these logprobs reach -45
            assert abs(got[token].logprob - logprob.logprob) <= tolerance, (token, got, expected)
