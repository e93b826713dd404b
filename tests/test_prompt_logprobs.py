"""Prompt logprobs against the transformers reference: whole prompts, chunked prefill, a prompt
whose prefix is cached, preemption and recompute, streams, n > 1, and bad values."""

from __future__ import annotations

import pytest
import torch
import transformers

from weft import LLM, SamplingParams

PROMPTS = [[(i * 37) % 380 + 3 for i in range(45)], [11, 12, 13, 14], [7, 300, 5]]


@pytest.fixture(scope="module")
def reference(tiny_llama):
    return transformers.AutoModelForCausalLM.from_pretrained(tiny_llama).eval()


def expected(reference, prompt: list[int], k: int) -> list[tuple[float, int, list[int]]]:
    """Per prompt token after the first: (its logprob, its rank, the top-k ids by logprob then id)."""
    with torch.no_grad():
        logprobs = torch.log_softmax(reference(torch.tensor([prompt])).logits[0].float(), dim=-1)  # [P, V]
    rows = []
    for position in range(len(prompt) - 1):
        row, token = logprobs[position], prompt[position + 1]
        rank = int((row > row[token]).sum()) + 1
        top = torch.sort(row, descending=True, stable=True).indices[:k].tolist()
        rows.append((float(row[token]), rank, top))
    return rows


def check(output, reference, prompt: list[int], k: int) -> None:
    assert output.prompt_logprobs is not None and len(output.prompt_logprobs) == len(prompt)
    assert output.prompt_logprobs[0] is None
    for position, (logprob, rank, top) in zip(
        output.prompt_logprobs[1:], expected(reference, prompt, k), strict=True
    ):
        token = next(iter(position))  # the actual prompt token comes first
        assert position[token].logprob == pytest.approx(logprob, abs=1e-4) and position[token].rank == rank
        assert set(top) <= set(position) and len(position) <= k + 1
        for alternative in position:
            if alternative != token:
                assert position[alternative].rank == top.index(alternative) + 1


@pytest.mark.parametrize("k", [0, 3])
def test_prompt_logprobs_match_transformers(tiny_llama, reference, k):
    llm = LLM(str(tiny_llama), show_progress=False, device="cpu", dtype="float32")
    outputs = llm.generate(PROMPTS, SamplingParams(prompt_logprobs=k, max_tokens=2), use_tqdm=False)
    for out, prompt in zip(outputs, PROMPTS, strict=True):
        check(out, reference, prompt, k)
        if k == 0:
            assert all(len(p) == 1 for p in out.prompt_logprobs[1:])


def test_chunked_prefill_prefix_cache_and_preemption(tiny_llama, reference):
    """A 16-token budget splits the prompt into chunks; the same prompt again is a prefix-cache
    hit for a plain request but computed whole for one that wants prompt logprobs; a tiny pool
    preempts and recomputes, and no position is recorded twice."""
    llm = LLM(
        str(tiny_llama),
        show_progress=False,
        device="cpu",
        dtype="float32",
        max_num_batched_tokens=16,
        block_size=4,
    )
    params = SamplingParams(prompt_logprobs=2, max_tokens=3)
    check(llm.generate([PROMPTS[0]], params, use_tqdm=False)[0], reference, PROMPTS[0], 2)
    llm.generate([PROMPTS[0]], SamplingParams(max_tokens=1), use_tqdm=False)
    assert llm.stats()["prefix_cache_hit_tokens"] > 0
    check(llm.generate([PROMPTS[0]], params, use_tqdm=False)[0], reference, PROMPTS[0], 2)
    small = LLM(
        str(tiny_llama),
        show_progress=False,
        device="cpu",
        dtype="float32",
        num_kv_blocks=17,
        block_size=4,
        max_model_len=64,
    )
    prompt = PROMPTS[0][:20]  # three fit at first, then grow past the 17 blocks
    many = small.generate(
        [prompt] * 3, SamplingParams(prompt_logprobs=1, max_tokens=30, ignore_eos=True), use_tqdm=False
    )
    assert small.stats()["num_preemptions"] > 0
    for out in many:
        check(out, reference, prompt, 1)


def test_stream_carries_prompt_logprobs_once_and_n_samples_share_them(tiny_llama, reference):
    llm = LLM(str(tiny_llama), show_progress=False, device="cpu", dtype="float32")
    chunks = list(llm.stream(PROMPTS[1], SamplingParams(prompt_logprobs=1, max_tokens=5)))
    carrying = [c for c in chunks if c.prompt_logprobs is not None]
    assert len(carrying) == 1
    check(carrying[0], reference, PROMPTS[1], 1)
    (out,) = llm.generate(
        [PROMPTS[2]], SamplingParams(prompt_logprobs=2, n=3, max_tokens=4, seed=1), use_tqdm=False
    )
    assert len(out.outputs) == 3
    check(out, reference, PROMPTS[2], 2)


def test_bad_prompt_logprobs_are_rejected(tiny_llama):
    llm = LLM(str(tiny_llama), show_progress=False, device="cpu", dtype="float32")
    with pytest.raises(ValueError, match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=-1)
    with pytest.raises(ValueError, match="max_logprobs"):
        llm.generate([PROMPTS[1]], SamplingParams(prompt_logprobs=21), use_tqdm=False)
