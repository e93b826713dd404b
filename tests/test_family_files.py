"""GGUF files of Qwen2-MoE and OLMo 2 made by llama.cpp's converter (tests/data/families; the other
families' files are in ../shared/data/gguf-families): weft reads each file's names and metadata
and computes what llama.cpp computed on it."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from weft import LLM, SamplingParams

DATA = Path(__file__).parent / "data" / "families"
REFERENCE = json.loads((DATA / "llama_cpp.json").read_text())

# file -> what its configuration must say (read from the GGUF metadata)
FILES = {
    "qwen2moe-f16": lambda c: (
        c.architecture == "Qwen2MoeForCausalLM"
        and not c.norm_topk_prob
        and (c.num_experts, c.experts_per_token, c.shared_expert_intermediate_size) == (8, 2, 48)
    ),
    "olmo2-f16": lambda c: c.architecture == "Olmo2ForCausalLM",
}


@pytest.mark.parametrize("name", sorted(FILES))
def test_a_family_file_computes_what_llama_cpp_computes(name):
    """Teacher-forced along llama.cpp's 16 greedy tokens after each of six prompts: weft's logprobs
    within 0.005 of llama.cpp's, within 0.001 on average (measured: Qwen2-MoE 0.0014 and 0.0004,
    OLMo 2 0.0047 and 0.0009), and its greedy tokens are llama.cpp's."""
    llm = LLM(str(DATA / f"{name}.gguf"), show_progress=False, max_logprobs=5)
    assert FILES[name](llm.config.model), llm.config.model
    runs, prompts = REFERENCE["files"][name], REFERENCE["prompts"]
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
