"""llama.cpp's outputs recorded on GGUF files (../shared/data/gguf, tests/data/quant_types), read
against weft's."""

from __future__ import annotations

from typing import Any

import numpy as np

from weft import LLM, SamplingParams


def teacher_forced_gap(
    llm: LLM, prompts: list[list[int]], runs: list[dict[str, Any]]
) -> tuple[float, int, int]:
    """Teacher-forced along llama.cpp's greedy tokens (`runs[i]["tokens"]` after `prompts[i]`): the
    mean |weft's logprob - llama.cpp's| of each token, how often weft's argmax is llama.cpp's, and
    over how many positions."""
    gaps, agree = [], 0
    for prompt, run in zip(prompts, runs, strict=True):
        ids = list(prompt) + list(run["tokens"])
        out = llm.generate([ids], SamplingParams(max_tokens=1, prompt_logprobs=1), use_tqdm=False)[0]
        positions = out.prompt_logprobs[len(prompt) :]
        for token, entry, expected, argmax in zip(
            run["tokens"], positions, run["tf_logprobs"], run["tf_argmax"], strict=True
        ):
            gaps.append(abs(entry[token].logprob - expected))
            agree += max(entry, key=lambda t: entry[t].logprob) == argmax
    return float(np.mean(gaps)), agree, len(gaps)
