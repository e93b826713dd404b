"""Qwen2-MoE from a GGUF file made by llama.cpp's converter (tests/data/qwen2moe): the shared expert
and its gate, routing weights left unnormalised, q/k/v biases and an untied output matrix read from
llama.cpp's names and metadata; weft computes what llama.cpp computed on the file."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from weft import LLM, SamplingParams

DATA = Path(__file__).parent / "data" / "qwen2moe"


def test_qwen2moe_computes_what_llama_cpp_computes():
    """Teacher-forced along llama.cpp's 16 greedy tokens after each of six prompts: weft's logprobs
    within 0.002 of llama.cpp's (mean within 0.001; measured 0.0004 and 0.0014), and its greedy
    tokens are llama.cpp's."""
    reference = json.loads((DATA / "llama_cpp.json").read_text())
    llm = LLM(str(DATA / "qwen2moe-f16.gguf"), show_progress=False, max_logprobs=5)
    config = llm.config.model
    assert config.architecture == "Qwen2MoeForCausalLM" and not config.norm_topk_prob
    assert (config.num_experts, config.experts_per_token, config.shared_expert_intermediate_size) == (
        8,
        2,
        48,
    )
    runs, prompts = reference["files"]["qwen2moe-f16"], reference["prompts"]
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
    assert max(gaps) <= 0.002 and float(np.mean(gaps)) <= 0.001, (max(gaps), np.mean(gaps))
    greedy = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    outs = llm.generate(prompts, greedy, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [run["tokens"] for run in runs]
