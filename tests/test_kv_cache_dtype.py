"""The KV cache's precision (`kv_cache_dtype`): float32, bfloat16, float16 or Q8_0 keys and values
beside float32 activations on CPU. The kernels that write and read the cache against float32 ones
over the same rounded values, Q8_0 blocks against gguf's reference, the engine's native path against
the torch path, the drift from a float32 cache, and the cache's bookkeeping (prefix caching, forks,
preemption) unchanged."""

from __future__ import annotations

import math

import pytest
import torch
from conftest import require_native_kernels

from weft import LLM, SamplingParams
from weft.config import ConfigError, kv_cache_dtype
from weft.kv_format import Q8_0, dequantize_q8_0, quantize_q8_0

HALF = [torch.bfloat16, torch.float16]
PROMPTS = ["First Citizen:", "You are all resolved", "We know't", "Speak, speak."]


def paged_cache(
    num_blocks: int, block_size: int, kv_heads: int, head_dim: int, seed: int = 0
) -> torch.Tensor:  # [blocks, block_size, 2, KVH, D]
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(num_blocks, block_size, 2, kv_heads, head_dim, generator=generator)


@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize("head_dim", [32, 64, 128, 80])
def test_decode_attention_reads_a_half_cache_as_its_float32_widening(dtype, head_dim):
    """Every head size (80: the generic loop), a window, sinks and soft-capping: the same numbers as
    the float32 kernel over the cache widened, up to the order of the sums."""
    require_native_kernels()
    heads, kv_heads, block_size = 8, 2, 16
    half = paged_cache(40, block_size, kv_heads, head_dim).to(dtype)
    q = torch.randn(3, heads, head_dim)  # [B, H, D]
    table = torch.randperm(40)[:36].view(3, 12).contiguous()
    lens = torch.tensor([5, 100, 191])
    sinks = torch.randn(heads)
    for window, sink, softcap in [(0, None, 0.0), (37, sinks, 0.0), (0, None, 5.0)]:
        args = (table, lens, head_dim**-0.5, window, sink, softcap)
        want = torch.ops.weft.paged_decode_attention(q, half.float(), *args)
        got = torch.ops.weft.paged_decode_attention(q, half, *args)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize("bf16_dot", [False, True])
def test_prefill_attention_reads_a_half_cache_as_its_float32_widening(dtype, bf16_dot):
    require_native_kernels()
    heads, kv_heads, head_dim = 8, 2, 64
    half = paged_cache(40, 16, kv_heads, head_dim, seed=1).to(dtype)
    q = torch.randn(45, heads, head_dim)  # [T, H, D]: 5, 10 and 30 queries
    table = torch.randperm(40)[:36].view(3, 12).contiguous()
    lens, starts = torch.tensor([5, 100, 191]), torch.tensor([0, 5, 15, 45])
    for window in (0, 50):
        args = (table, lens, starts, 0.125, bf16_dot, window, None, 0.0)
        want = torch.ops.weft.paged_prefill_attention(q, half.float(), *args)
        got = torch.ops.weft.paged_prefill_attention(q, half, *args)
        assert torch.equal(got, want)  # the same float32 values through the same loops


@pytest.mark.parametrize("dtype", [torch.float32, *HALF])
def test_written_keys_and_values_round_as_torch_rounds_them(dtype):
    """`write_kv_` from the strided k|v rows of a q|k|v output: bit for bit torch's conversion
    (to nearest even), infinities and the largest float16 overflow included."""
    require_native_kernels()
    qkv = torch.randn(7, 12, 64) * 100  # [T, H + 2 KVH, D]: 8 query heads, 2 KV heads
    qkv[0, 8, :4] = torch.tensor([70000.0, -1e-9, float("inf"), 65519.0])
    kv = qkv[:, 8:].view(7, 2, 2, 64)
    slots = torch.tensor([3, 17, 40, 41, 200, 300, 5])
    native = torch.zeros(20, 16, 2, 2, 64, dtype=dtype)
    torch.ops.weft.write_kv_(native, kv, slots)
    expected = torch.zeros_like(native)
    expected.view(-1, 2, 2, 64).index_copy_(0, slots, kv.to(dtype))
    assert torch.equal(native, expected)


def q8_cache(num_blocks: int, block_size: int, kv_heads: int, head_dim: int, seed: int = 0) -> torch.Tensor:
    """A random cache in Q8_0 blocks: [blocks, block_size, 2, KVH, D / 32 * 34] uint8."""
    return quantize_q8_0(paged_cache(num_blocks, block_size, kv_heads, head_dim, seed))


def test_q8_0_blocks_are_llama_cpps():
    """Written by the native kernel and by the torch path: byte for byte gguf's reference
    quantization (halves rounded away from zero, a zero block's scale 0), and read back as gguf's
    dequantization."""
    from gguf import GGMLQuantizationType, quants

    qkv = torch.randn(7, 12, 64) * 3  # [T, H + 2 KVH, D]: 8 query heads, 2 KV heads
    qkv[1, 8, :32] = 0.0  # a zero block
    qkv[2, 9, :32] = torch.arange(32) - 15.5  # ties: 127 * k / 15.5 lands on halves
    kv = qkv[:, 8:].view(7, 2, 2, 64)
    reference = quants.quantize(kv.contiguous().numpy(), GGMLQuantizationType.Q8_0)  # [7, 2, 2, 68]
    assert torch.equal(quantize_q8_0(kv), torch.from_numpy(reference))
    expected = quants.dequantize(reference, GGMLQuantizationType.Q8_0)
    assert torch.equal(dequantize_q8_0(quantize_q8_0(kv)), torch.from_numpy(expected))
    require_native_kernels()
    slots = torch.tensor([3, 17, 40, 41, 200, 300, 5])
    native = torch.zeros(20, 16, 2, 2, 68, dtype=torch.uint8)
    torch.ops.weft.write_kv_(native, kv, slots)
    plain = torch.zeros_like(native)
    plain.view(-1, 2, 2, 68).index_copy_(0, slots, torch.from_numpy(reference))
    assert torch.equal(native, plain)


@pytest.mark.parametrize("head_dim", [32, 64, 128, 96])
def test_decode_attention_reads_a_q8_cache_as_its_dequantization(head_dim):
    """Every head size (96: the generic loop), a window, sinks and soft-capping: the float32
    kernel's numbers over the cache dequantized."""
    require_native_kernels()
    heads, kv_heads = 8, 2
    cache = q8_cache(40, 16, kv_heads, head_dim)
    q = torch.randn(3, heads, head_dim)  # [B, H, D]
    table = torch.randperm(40)[:36].view(3, 12).contiguous()
    lens = torch.tensor([5, 100, 191])
    for window, sink, softcap in [(0, None, 0.0), (37, torch.randn(heads), 0.0), (0, None, 5.0)]:
        args = (table, lens, head_dim**-0.5, window, sink, softcap)
        want = torch.ops.weft.paged_decode_attention(q, dequantize_q8_0(cache), *args)
        got = torch.ops.weft.paged_decode_attention(q, cache, *args)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("bf16_dot", [False, True])
def test_prefill_attention_reads_a_q8_cache_as_its_dequantization(bf16_dot):
    require_native_kernels()
    cache = q8_cache(40, 16, 2, 64, seed=1)
    q = torch.randn(45, 8, 64)  # [T, H, D]: 5, 10 and 30 queries
    table = torch.randperm(40)[:36].view(3, 12).contiguous()
    lens, starts = torch.tensor([5, 100, 191]), torch.tensor([0, 5, 15, 45])
    for window in (0, 50):
        args = (table, lens, starts, 0.125, bf16_dot, window, None, 0.0)
        want = torch.ops.weft.paged_prefill_attention(q, dequantize_q8_0(cache), *args)
        assert torch.equal(torch.ops.weft.paged_prefill_attention(q, cache, *args), want)


def test_a_q8_cache_is_refused_where_it_cannot_serve():
    """On CUDA, beside half activations, and for heads that are not whole blocks: each says why."""
    with pytest.raises(ConfigError, match="'q8_0' is a CPU cache; on cuda use float16 or bfloat16"):
        kv_cache_dtype("q8_0", torch.bfloat16, torch.device("cuda"))
    with pytest.raises(ConfigError, match="needs float32 activations"):
        kv_cache_dtype("q8_0", torch.bfloat16, torch.device("cpu"))
    assert kv_cache_dtype("q8_0", torch.float32, torch.device("cpu")) == Q8_0
    require_native_kernels()
    with pytest.raises(RuntimeError, match="a Q8_0 cache needs head_dim a multiple of 32"):
        torch.ops.weft.paged_decode_attention(
            torch.randn(1, 4, 16), torch.zeros(2, 16, 2, 2, 0, dtype=torch.uint8),
            torch.zeros(1, 1, dtype=torch.long), torch.tensor([3]), 1.0,
        )  # fmt: skip


def test_a_cache_of_another_dtype_is_refused_with_the_reason():
    require_native_kernels()
    q = torch.randn(1, 4, 32, dtype=torch.bfloat16)
    cache = paged_cache(2, 16, 2, 32).half()
    with pytest.raises(RuntimeError, match="bfloat16, float16 or Q8_0 \\(uint8\\) beside float32 q"):
        torch.ops.weft.paged_decode_attention(
            q, cache, torch.zeros(1, 1, dtype=torch.long), torch.tensor([3]), 1.0
        )


def prompt_logprobs(llm: LLM, prompts: list[str]) -> list[list[float]]:
    outs = llm.generate(prompts, SamplingParams(max_tokens=1, prompt_logprobs=0), use_tqdm=False)
    return [
        [next(iter(p.values())).logprob for p in out.prompt_logprobs[1:]]  # the prompt token's own
        for out in outs
    ]


@pytest.fixture(scope="module")
def checkpoint(checkpoint_factory):
    return str(checkpoint_factory("llama", hidden_size=256, intermediate_size=512))


def logprob_records(llm: LLM, params: SamplingParams) -> list[tuple]:
    outs = llm.generate(PROMPTS, params)
    return [(o.prompt_logprobs, o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outs]


ROUNDINGS = {
    "float16": lambda kv: kv.half().float(),
    "bfloat16": lambda kv: kv.bfloat16().float(),
    "q8_0": lambda kv: dequantize_q8_0(quantize_q8_0(kv)),
}


@pytest.mark.parametrize("name", ["float16", "bfloat16", "q8_0"])
def test_a_half_or_q8_cache_computes_what_a_float32_cache_of_the_rounded_values_does(
    checkpoint, name, monkeypatch
):
    """Prompt and decode logprobs with a half-precision or Q8_0 cache, bit for bit those of a
    float32 cache whose keys and values were rounded to that format as they were written: the
    cache's kernels widen exactly and change nothing else. (Layer by layer: the fused decoder stack
    writes in C++, out of the patch's reach.)"""
    require_native_kernels()
    from weft.kernels import NativeCpuKernels

    params = SamplingParams(temperature=0, max_tokens=16, logprobs=3, prompt_logprobs=3, ignore_eos=True)
    monkeypatch.setattr(NativeCpuKernels, "has_decoder_stack", lambda self, device, activations: False)
    half = logprob_records(LLM(checkpoint, show_progress=False, kv_cache_dtype=name), params)
    write = NativeCpuKernels.write_kv_

    def rounded(self, kv_cache, kv, slot_mapping):
        write(self, kv_cache, ROUNDINGS[name](kv), slot_mapping)

    monkeypatch.setattr(NativeCpuKernels, "write_kv_", rounded)
    assert logprob_records(LLM(checkpoint, show_progress=False, kv_cache_dtype="float32"), params) == half


@pytest.mark.parametrize("name", ["float16", "q8_0"])
def test_the_torch_path_reads_and_writes_a_half_or_q8_cache(checkpoint, name, monkeypatch):
    """Without weft's kernels (index_copy_ of the rounded keys, gathered and widened for SDPA):
    the native path's logprobs within the few 1e-4 that a key rounded the other way moves them."""
    params = SamplingParams(temperature=0, max_tokens=8, logprobs=0, prompt_logprobs=0, ignore_eos=True)
    native = LLM(checkpoint, show_progress=False, kv_cache_dtype=name)
    monkeypatch.setattr("weft.engine.loading.use_kernels", lambda device: False)
    plain = LLM(checkpoint, show_progress=False, kv_cache_dtype=name)
    assert plain.kernels["kernels"] == "torch" and plain.kernels["kv_cache"].startswith(name)
    for a, b in zip(native.generate(PROMPTS, params), plain.generate(PROMPTS, params), strict=True):
        tokens = a.prompt_token_ids[1:]
        for p, q, t in zip(a.prompt_logprobs[1:], b.prompt_logprobs[1:], tokens, strict=True):
            assert p[t].logprob == pytest.approx(q[t].logprob, abs=2e-3)
    assert plain.stats()["kv_blocks_used"] == 0


def test_drift_from_a_float32_cache(checkpoint):
    """Mean |difference| of teacher-forced logprobs from a float32 cache's, on a random model of 256
    inputs (measured: float16 0.0015, bfloat16 0.010, q8_0 0.041): float16 keeps three more bits
    than bfloat16; Q8_0's 8 bits are relative to each block's largest element, not to each value."""
    reference = prompt_logprobs(LLM(checkpoint, show_progress=False, kv_cache_dtype="float32"), PROMPTS)
    gaps = {}
    for dtype in ("float16", "bfloat16", "q8_0"):
        got = prompt_logprobs(LLM(checkpoint, show_progress=False, kv_cache_dtype=dtype), PROMPTS)
        diffs = [
            abs(a - b) for xs, ys in zip(got, reference, strict=True) for a, b in zip(xs, ys, strict=True)
        ]
        gaps[dtype] = math.fsum(diffs) / len(diffs)
    print(gaps)
    assert 0 < gaps["float16"] < 3e-3 and gaps["float16"] * 4 < gaps["bfloat16"] < 3e-2
    assert gaps["bfloat16"] < gaps["q8_0"] < 0.1


@pytest.mark.parametrize("name", ["float16", "q8_0"])
def test_preemption_prefix_hits_and_forks_keep_the_half_or_q8_cache_exact(checkpoint, name):
    """With a float16 or Q8_0 cache: a preempted run recomputes the very numbers (tokens and logprobs) of a
    roomy one; a prompt served from cached blocks the tokens it had; n=3 the tokens of three
    seeded requests; no block is lost."""
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, logprobs=2)
    options = {"show_progress": False, "block_size": 8, "max_model_len": 64, "kv_cache_dtype": name}
    roomy = LLM(checkpoint, **options)
    expected = [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in roomy.generate(PROMPTS, params)]
    long = SamplingParams(max_tokens=8, temperature=0, logprobs=0)  # (prompt logprobs would skip the cache)
    first = roomy.generate(PROMPTS[0] * 4, long)[0].outputs[0]
    hits = roomy.stats()["prefix_cache_hit_tokens"]
    again = roomy.generate(PROMPTS[0] * 4, long)[0].outputs[0]
    assert roomy.stats()["prefix_cache_hit_tokens"] > hits
    assert again.token_ids == first.token_ids  # (the rest of the prompt in other kernels: close, not equal)
    for got, want, token in zip(again.logprobs, first.logprobs, first.token_ids, strict=True):
        assert got[token].logprob == pytest.approx(want[token].logprob, abs=2e-3)
    small = LLM(checkpoint, num_kv_blocks=10, **options)
    outputs = small.generate(PROMPTS, params)
    assert small.stats()["num_preemptions"] > 0
    assert [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outputs] == expected
    sampled = SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=12)
    (forked,) = roomy.generate(PROMPTS[0], sampled)
    for i, completion in enumerate(forked.outputs):
        (single,) = roomy.generate(PROMPTS[0], sampled.replace(n=1, seed=7 + i))
        assert completion.token_ids == single.outputs[0].token_ids
    assert roomy.stats()["kv_blocks_used"] == 0 and small.stats()["kv_blocks_used"] == 0


def test_the_cache_says_its_dtype_and_size(checkpoint):
    """`kernels` and `stats()` name the format and bytes a token; a half cache holds twice the
    blocks in the same memory; auto keeps float32 beside float32 weights."""
    auto = LLM(checkpoint, show_progress=False, kv_cache_memory_gb=0.01)
    half = LLM(checkpoint, show_progress=False, kv_cache_memory_gb=0.01, kv_cache_dtype="float16")
    q8 = LLM(checkpoint, show_progress=False, kv_cache_memory_gb=0.01, kv_cache_dtype="q8_0")
    config = auto.config.model
    per_token = 2 * config.num_kv_heads * config.head_dim * config.num_layers
    assert auto.kernels["kv_cache"] == f"float32 ({4 * per_token:,} bytes a token)"
    assert half.kernels["kv_cache"] == f"float16 ({2 * per_token:,} bytes a token)"
    assert half.stats()["kv_bytes_per_token"] == 2 * per_token
    assert abs(half.stats()["kv_blocks_total"] - 2 * auto.stats()["kv_blocks_total"]) <= 1
    assert q8.kernels["kv_cache"] == f"q8_0 ({per_token * 34 // 32:,} bytes a token)"
    blocks = auto.stats()["kv_blocks_total"]  # (what is left of the budget: under one float32 block)
    assert 128 * blocks / 34 - 1 <= q8.stats()["kv_blocks_total"] <= 128 * (blocks + 1) / 34


def test_a_bad_kv_cache_dtype_names_the_choices(checkpoint):
    choices = "auto, float32, bfloat16, float16, q8_0"
    with pytest.raises(ConfigError, match=f"kv_cache_dtype must be one of {choices}"):
        LLM(checkpoint, show_progress=False, kv_cache_dtype="int4")


def test_the_default_context_is_the_models_own_as_far_as_the_kv_budget_holds_it(checkpoint_factory):
    """A model of 65,536 positions: as many as one sequence's cache fits in the KV budget (twice
    as many in float16), never fewer than 8,192, the model's own where the budget holds them all;
    a context asked for is kept."""
    path = str(checkpoint_factory("llama", max_position_embeddings=65536))
    config = LLM(path, show_progress=False, max_model_len=64).config.model
    per_token = 2 * config.num_kv_heads * config.head_dim * config.num_layers * 4  # float32
    budget = 12000 * per_token / 1024**3  # GiB: 12,000 float32 tokens
    for dtype, tokens in [("float32", 12000), ("float16", 24000)]:
        llm = LLM(path, show_progress=False, kv_cache_memory_gb=budget, kv_cache_dtype=dtype)
        assert abs(llm.config.scheduler.max_model_len - tokens) <= 1
    small = LLM(path, show_progress=False, kv_cache_memory_gb=budget / 4)
    assert small.config.scheduler.max_model_len == 8192
    assert LLM(path, show_progress=False).config.scheduler.max_model_len == 65536  # (2 GiB holds them)
    assert LLM(path, show_progress=False, max_model_len=1000).config.scheduler.max_model_len == 1000
