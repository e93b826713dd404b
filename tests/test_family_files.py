"""GGUF files of Qwen2-MoE, OLMo 2 and Phi-3 made by llama.cpp's converter (tests/data/families; the
other families' files are in ../shared/data/gguf-families): weft reads each file's names and
metadata and computes what llama.cpp computed on it (Phi-3's, which llama.cpp will not load over
the tests' tokenizer: what transformers computed on the checkpoint it was converted from)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from weft import LLM, SamplingParams

DATA = Path(__file__).parent / "data" / "families"
REFERENCE = json.loads((DATA / "llama_cpp.json").read_text())
TRANSFORMERS = json.loads((DATA / "transformers.json").read_text())

# file -> what its configuration must say (read from the GGUF metadata)
FILES = {
    "qwen2moe-f16": lambda c: (
        c.architecture == "Qwen2MoeForCausalLM"
        and not c.norm_topk_prob
        and (c.num_experts, c.experts_per_token, c.shared_expert_intermediate_size) == (8, 2, 48)
    ),
    "olmo2-f16": lambda c: c.architecture == "Olmo2ForCausalLM",
    # 3/4 of each head rotating (12 of 16 dimensions), LongRoPE over an original 64 positions with
    # the attention factor llama.cpp's converter wrote (sqrt(1 + ln 8 / ln 64))
    "phi3-f16": lambda c: (
        c.architecture == "Phi3ForCausalLM"
        and (c.rope.rope_type, c.rope.partial_rotary_factor, c.rope.original_max_position_embeddings)
        == ("longrope", 0.75, 64)
        and c.rope.short_factor == pytest.approx((1.0, 1.1, 1.3, 1.6, 2.0, 2.5))  # (float32 in the file)
        and c.rope.attention_factor == pytest.approx(1.5**0.5)
    ),
}


@pytest.mark.parametrize("name", sorted(FILES))
def test_a_family_file_computes_what_llama_cpp_computes(name):
    """Teacher-forced along llama.cpp's 16 greedy tokens after each of six prompts: weft's logprobs
    within 0.005 of llama.cpp's, within 0.001 on average (measured: Qwen2-MoE 0.0014 and 0.0004,
    OLMo 2 0.0047 and 0.0009; Phi-3 against transformers, its float32 weights rounded to float16 in
    the file: 0.0017 and 0.0005), and its greedy tokens are llama.cpp's. Phi-3's LongRoPE takes its
    long factors past the original 64 positions (the five prompts of 80), its short ones within them
    (the prompt of 5, in a context of 64), as transformers does for a forward of that length."""
    reference = TRANSFORMERS if name in TRANSFORMERS["files"] else REFERENCE
    runs, prompts = reference["files"][name], reference["prompts"]
    llm = LLM(str(DATA / f"{name}.gguf"), show_progress=False, max_logprobs=5)
    assert FILES[name](llm.config.model), llm.config.model
    if name == "phi3-f16":  # (the short prompt in a context within the original one)
        short = LLM(str(DATA / f"{name}.gguf"), show_progress=False, max_logprobs=5, max_model_len=64)
        _check(short, prompts[5:], runs[5:])
        prompts, runs = prompts[:5], runs[:5]
    _check(llm, prompts, runs)


def _check(llm: LLM, prompts: list[list[int]], runs: list[dict]) -> None:
    forced = llm.generate(
        [p + run["tokens"] for p, run in zip(prompts, runs, strict=True)],
        SamplingParams(max_tokens=1, prompt_logprobs=1),
        use_tqdm=False,
    )
    gaps = [
        abs(step[token].logprob - logprob)
        for prompt, run, out in zip(prompts, runs, forced, strict=True)
        for token, step, logprob in zip(
            run["tokens"], out.prompt_logprobs[len(prompt) :], run["tf_logprobs"], strict=True
        )
    ]
    assert max(gaps) <= 0.005 and float(np.mean(gaps)) <= 0.001, (max(gaps), np.mean(gaps))
    greedy = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    outs = llm.generate(prompts, greedy, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [run["tokens"] for run in runs]


def test_a_quantized_phi3_file_runs_its_fused_matrices_from_their_blocks(tmp_path):
    """phi3-f16.gguf in Q8_0 (`weft quantize`): its fused q|k|v (cut in three, q's and k's rows
    reordered for the partial rotary embedding, all in their blocks) and gate|up run through the
    int8 dot panels, within Q8_0's and int8 activations' rounding of the float16 file (measured on
    the first prompt's 79 tokens: 0.10 at most, 0.021 on average; rows split or ordered wrongly
    move them by whole nats)."""
    from weft.model.gguf_quantize import quantize_gguf

    quantized = tmp_path / "phi3-q8_0.gguf"
    quantize_gguf(DATA / "phi3-f16.gguf", quantized, "q8_0", show_progress=False)
    prompt = REFERENCE["prompts"][0]
    logprobs = []
    for path in (DATA / "phi3-f16.gguf", quantized):
        llm = LLM(str(path), show_progress=False)
        (out,) = llm.generate([prompt], SamplingParams(max_tokens=1, prompt_logprobs=0), use_tqdm=False)
        steps = zip(out.prompt_logprobs[1:], prompt[1:], strict=True)
        logprobs.append(np.array([step[token].logprob for step, token in steps]))
    assert "Q8_0 for 17 matrices (int8 dot panels)" in llm.kernels["linear"]
    gaps = np.abs(logprobs[0] - logprobs[1])
    assert 0 < gaps.mean() < 0.04 and gaps.max() < 0.2, (gaps.max(), gaps.mean())
