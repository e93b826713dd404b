"""weft's model against the `transformers` reference on the same tiny random checkpoints."""

from __future__ import annotations

import pytest
import torch
import transformers
from conftest import DEVICES

from weft import LLM, SamplingParams

# The reference runs on CPU in float32; weft runs in float32 too, on the CPU and, where there is
# one, on a CUDA GPU (LLM's default there would be bfloat16).
ON_CPU = {"device": "cpu", "dtype": "float32"}
VOCAB_ALL = 100_000  # max_logprobs high enough for a whole (tiny) vocabulary
ARCHS = [
    "llama",
    "llama3",
    "llama-untied",
    "mistral",
    "qwen2",
    "qwen3",
    "qwen3-yarn",
    "granite",
    "smollm3",
    "olmo2",
    "gemma2",
    "gemma3",
    "qwen3moe",
    "qwen2moe",
    "mixtral",
    "olmoe",
    "gptoss",
]
PROMPTS = [
    [5, 17, 42, 99, 100, 7, 8, 250, 31, 64, 12, 77, 300, 2, 9, 1, 44, 45, 46, 47, 48],  # 21 tokens
    [11, 12, 13],
    [200, 201, 202, 203, 204, 205, 206, 207, 208, 209],
    [3],
]


def parity_llm(path, **options) -> LLM:
    """weft on CPU in float32 with logprobs over the whole (tiny) vocabulary."""
    return LLM(str(path), show_progress=False, max_logprobs=VOCAB_ALL, **ON_CPU, **options)


def reference_logprobs(model, prompt: list[int]) -> torch.Tensor:  # [V]
    with torch.no_grad():
        logits = model(torch.tensor([prompt])).logits[0, -1]
    return torch.log_softmax(logits.float(), dim=-1)


def weft_logprobs(llm: LLM, prompts: list[list[int]]) -> list[torch.Tensor]:
    vocab = llm.config.model.vocab_size
    params = SamplingParams(max_tokens=1, temperature=0, logprobs=vocab)
    outputs = llm.generate(prompts, params, use_tqdm=False)
    result = []
    for out in outputs:
        position = out.outputs[0].logprobs[0]
        row = torch.full((vocab,), float("nan"))
        for token_id, lp in position.items():
            row[token_id] = lp.logprob
        result.append(row)
    return result


def assert_generated_positions_match(reference, prompt: list[int], completion, vocab: int) -> None:
    """Every generated position's distribution (all `vocab` logprobs) is the reference's after the
    prompt and the tokens generated before it."""
    for i, position in enumerate(completion.logprobs):
        actual = torch.full((vocab,), float("nan"))
        for token_id, lp in position.items():
            actual[token_id] = lp.logprob
        assert_close(actual, reference_logprobs(reference, prompt + completion.token_ids[:i]))


def assert_close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    # Relative tolerance 1e-4 on values of order 1-10, plus a small absolute floor.
    torch.testing.assert_close(actual, expected, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("arch", ARCHS)
def test_logits_match_transformers_batched(checkpoint_factory, arch, device):
    path = checkpoint_factory(arch)
    reference = transformers.AutoModelForCausalLM.from_pretrained(path).eval()
    llm = LLM(str(path), show_progress=False, max_logprobs=VOCAB_ALL, device=device, dtype="float32")
    for actual, prompt in zip(weft_logprobs(llm, PROMPTS), PROMPTS, strict=True):
        assert_close(actual, reference_logprobs(reference, prompt))
    assert llm.stats()["kv_blocks_used"] == 0


def test_logits_match_after_chunked_prefill_and_prefix_hit(checkpoint_factory):
    path = checkpoint_factory("llama")
    reference = transformers.AutoModelForCausalLM.from_pretrained(path).eval()
    long_prompt = [(i * 37) % 380 + 3 for i in range(70)]
    # A 16-token budget forces the 70-token prompt through 5 chunks; blocks of 8 make prefix hits likely.
    llm = parity_llm(path, max_num_batched_tokens=16, block_size=8)
    (first,) = weft_logprobs(llm, [long_prompt])
    assert_close(first, reference_logprobs(reference, long_prompt))
    extended = [*long_prompt[:64], 5, 6, 7]
    (second,) = weft_logprobs(llm, [extended])
    assert llm.stats()["prefix_cache_hit_tokens"] >= 64
    assert_close(second, reference_logprobs(reference, extended))


@pytest.mark.parametrize("arch", ["llama", "qwen3", "olmo2", "gemma3", "qwen3moe"])
def test_greedy_tokens_equal_transformers_generate(checkpoint_factory, arch):
    path = checkpoint_factory(arch)
    reference = transformers.AutoModelForCausalLM.from_pretrained(path).eval()
    llm = parity_llm(path)
    params = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
    outputs = llm.generate(PROMPTS[:3], params, use_tqdm=False)
    for out, prompt in zip(outputs, PROMPTS[:3], strict=True):
        with torch.no_grad():
            expected = reference.generate(
                torch.tensor([prompt]), do_sample=False, max_new_tokens=64, min_new_tokens=64, pad_token_id=0
            )[0, len(prompt) :].tolist()
        assert out.outputs[0].token_ids == expected


def test_logits_match_in_mixed_decode_and_prefill_steps(checkpoint_factory):
    """A 6-token budget makes prompts prefill in chunks while other sequences decode in the same
    step; every generated position's distribution must still match the reference."""
    path = checkpoint_factory("llama")
    reference = transformers.AutoModelForCausalLM.from_pretrained(path).eval()
    llm = parity_llm(path, max_num_batched_tokens=6, block_size=4)
    vocab = llm.config.model.vocab_size
    outputs = llm.generate(
        PROMPTS, SamplingParams(max_tokens=4, temperature=0, logprobs=vocab), use_tqdm=False
    )
    for prompt, out in zip(PROMPTS, outputs, strict=True):
        assert_generated_positions_match(reference, prompt, out.outputs[0], vocab)


def test_logits_match_for_equal_length_fresh_prompts(checkpoint_factory):
    """Equal fresh prompts take plain causal attention (no mask, no padding)."""
    path = checkpoint_factory("qwen2")
    reference = transformers.AutoModelForCausalLM.from_pretrained(path).eval()
    prompts = [[7 + i, 30, 31 + i, 99, 5, 6, 200 + i, 8] for i in range(3)]
    llm = parity_llm(path)
    for actual, prompt in zip(weft_logprobs(llm, prompts), prompts, strict=True):
        assert_close(actual, reference_logprobs(reference, prompt))


def test_phi3_partial_rotary_and_longrope_match_transformers(checkpoint_factory):
    """Phi-3's fused q|k|v and gate|up, 3/4 of each head rotating (weft reorders q's and k's head
    dimensions so that its whole-head rotation does it), LongRoPE: a context no longer than the
    original one takes the short factors, as transformers does for a sequence that fits it; a
    longer context the long factors, as transformers does for a forward past it (an 80-token
    prompt; transformers switches per forward, weft by the context, as llama.cpp does)."""
    path = checkpoint_factory("phi3")
    reference = transformers.AutoModelForCausalLM.from_pretrained(path).eval()
    short = parity_llm(path, max_model_len=64)
    for actual, prompt in zip(weft_logprobs(short, PROMPTS), PROMPTS, strict=True):
        assert_close(actual, reference_logprobs(reference, prompt))
    long_prompt = [(i * 37) % 380 + 3 for i in range(80)]
    long = parity_llm(path)
    (actual,) = weft_logprobs(long, [long_prompt])
    assert_close(actual, reference_logprobs(reference, long_prompt))
    (with_long, with_short) = (weft_logprobs(llm, [long_prompt[:60]])[0] for llm in (long, short))
    assert not torch.allclose(with_long, with_short, atol=1e-3)  # the factors do differ


WINDOWED = {  # sliding windows of 8 keys: Mistral's in every layer, Qwen2's from its second layer on,
    # Gemma 3's in three layers of four, gpt-oss's in every other layer (with attention sinks)
    "gemma2": {},
    "gemma3": {},
    "gptoss": {},
    "mistral": {"sliding_window": 8},
    "qwen2": {"sliding_window": 8, "use_sliding_window": True, "max_window_layers": 1},
}


@pytest.mark.parametrize("arch", sorted(WINDOWED))
def test_sliding_windows_match_transformers_past_the_window(checkpoint_factory, arch):
    """Prompts and generations several windows long: teacher-forced logprobs at every generated
    position (decode rows, prompt chunks of 6 tokens beside them, blocks of 4 so that windows start
    mid-block), then greedy tokens; Qwen2's window with `use_sliding_window: false` is none."""
    path = checkpoint_factory(arch, **WINDOWED[arch])
    reference = transformers.AutoModelForCausalLM.from_pretrained(path).eval()
    assert reference.config.sliding_window == 8
    llm = parity_llm(path, max_num_batched_tokens=6, block_size=4)
    assert llm.config.model.sliding_window == 8
    vocab = llm.config.model.vocab_size
    params = SamplingParams(max_tokens=12, temperature=0, logprobs=vocab, ignore_eos=True)
    for prompt, out in zip(PROMPTS, llm.generate(PROMPTS, params, use_tqdm=False), strict=True):
        assert_generated_positions_match(reference, prompt, out.outputs[0], vocab)
    greedy = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    (out,) = parity_llm(path).generate([PROMPTS[0]], greedy, use_tqdm=False)
    with torch.no_grad():
        expected = reference.generate(
            torch.tensor([PROMPTS[0]]), do_sample=False, max_new_tokens=40, min_new_tokens=40, pad_token_id=0
        )[0, len(PROMPTS[0]) :].tolist()
    assert out.outputs[0].token_ids == expected
    off = checkpoint_factory("qwen2", sliding_window=8, use_sliding_window=False)
    assert LLM(str(off), show_progress=False).config.model.sliding_window is None
