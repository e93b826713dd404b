"""The Triton kernel set (weft/cuda) against the torch path: on a CUDA GPU where there is one, and
on CPU tensors in Triton's interpreter (conftest sets TRITON_INTERPRET=1 when there is no GPU)."""

from __future__ import annotations

import os
import random

import pytest
import torch
import transformers

from weft import LLM, SamplingParams
from weft.cuda.attention import paged_attention as triton_attention
from weft.cuda.kernels import TRITON_KERNELS
from weft.kernels import TORCH_KERNELS, RopeTables
from weft.model.attention import build_attention_metadata, paged_attention

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def random_step(
    query_lens: list[int], context_lens: list[int], block_size: int, seed: int
) -> tuple[list[list[int]], int]:
    """Block tables drawn at random from a shuffled pool (ragged, out of order), and the pool size."""
    needed = [-(-ctx // block_size) for ctx in context_lens]
    num_blocks = sum(needed) + 3
    pool = list(range(1, num_blocks))
    random.Random(seed).shuffle(pool)
    tables, start = [], 0
    for count in needed:
        tables.append(pool[start : start + count])
        start += count
    return tables, num_blocks


def attend_both_ways(
    query_lens: list[int],
    context_lens: list[int],
    head_dim: int,
    num_heads: int,
    num_kv_heads: int,
    block_size: int,
    dtype: torch.dtype = torch.float32,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(Triton, SDPA) attention outputs [T, H * D] of one step over the same cache."""
    tables, num_blocks = random_step(query_lens, context_lens, block_size, seed=sum(context_lens))
    gen = torch.Generator().manual_seed(len(query_lens) * 1000 + head_dim)
    num_tokens = sum(query_lens)
    cache = torch.randn(num_blocks, block_size, 2, num_kv_heads, head_dim, generator=gen).to(DEVICE, dtype)
    q = torch.randn(num_tokens, num_heads, head_dim, generator=gen).to(DEVICE, dtype)  # [T, H, D]
    kv = torch.randn(num_tokens, 2, num_kv_heads, head_dim, generator=gen).to(DEVICE, dtype)
    outs = []
    for ragged in (True, False):
        meta, _ = build_attention_metadata(query_lens, context_lens, tables, block_size, DEVICE, 1, ragged)
        kernels = TRITON_KERNELS if ragged else TORCH_KERNELS
        outs.append(paged_attention(q, kv, cache.clone(), meta, head_dim**-0.5, kernels))
    return outs[0], outs[1]


# Mixed rows: decode (1 new token), a fresh prompt, a chunk on top of cached tokens, forced tokens.
MIXED = ([1, 9, 1, 20, 3], [37, 9, 5, 52, 40])


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("gqa", [1, 4, 8])
@pytest.mark.parametrize("block_size", [16, 32])
def test_paged_kernel_matches_sdpa(head_dim, gqa, block_size):
    num_kv_heads = 2
    triton_out, sdpa_out = attend_both_ways(*MIXED, head_dim, gqa * num_kv_heads, num_kv_heads, block_size)
    torch.testing.assert_close(triton_out, sdpa_out, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    ("query_lens", "context_lens"),
    [
        ([1] * 6, [1, 16, 17, 33, 64, 5]),  # decode only, block boundaries
        ([24], [24]),  # one fresh prompt longer than a tile
        ([7, 7], [7, 7]),  # equal fresh prompts
        ([2, 70], [45, 70]),  # forced tokens beside a long prompt: several query tiles
    ],
)
def test_paged_kernel_ragged_shapes(query_lens, context_lens):
    triton_out, sdpa_out = attend_both_ways(query_lens, context_lens, 64, 6, 2, 16)
    torch.testing.assert_close(triton_out, sdpa_out, rtol=1e-5, atol=1e-5)


def test_paged_kernel_bfloat16():
    triton_out, sdpa_out = attend_both_ways(*MIXED, 64, 8, 2, 16, dtype=torch.bfloat16)
    torch.testing.assert_close(triton_out.float(), sdpa_out.float(), rtol=2e-2, atol=2e-2)


def test_paged_kernel_rejects_a_strided_cache():
    cache = torch.zeros(4, 16, 2, 2, 128, device=DEVICE)[..., :64]  # head dims not contiguous
    meta, _ = build_attention_metadata([1], [3], [[1]], 16, DEVICE, 1, True)
    assert meta.ragged is not None
    with pytest.raises(ValueError, match="contiguous"):
        triton_attention(torch.zeros(1, 2, 64, device=DEVICE), cache, meta.ragged, 0.125)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_norms_match_torch(dtype):
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(5, 96, generator=gen).to(DEVICE, dtype)
    delta = torch.randn(5, 96, generator=gen).to(DEVICE, dtype)
    weight = torch.randn(96, generator=gen).to(DEVICE, dtype)
    tol = {"rtol": 1e-5, "atol": 1e-5} if dtype == torch.float32 else {"rtol": 2e-2, "atol": 2e-2}
    torch.testing.assert_close(
        TRITON_KERNELS.rms_norm(x, weight, 1e-6), TORCH_KERNELS.rms_norm(x, weight, 1e-6), **tol
    )
    x_triton, x_torch = x.clone(), x.clone()
    normed_triton = TRITON_KERNELS.add_rms_norm_(x_triton, delta, weight, 1e-6)
    normed_torch = TORCH_KERNELS.add_rms_norm_(x_torch, delta, weight, 1e-6)
    torch.testing.assert_close(x_triton, x_torch, **tol)  # the residual stream: the same sum
    torch.testing.assert_close(normed_triton, normed_torch, **tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_silu_mul_matches_torch(dtype):
    gate_up = torch.randn(3, 2 * 1100, generator=torch.Generator().manual_seed(1)).to(DEVICE, dtype)
    tol = {"rtol": 1e-5, "atol": 1e-6} if dtype == torch.float32 else {"rtol": 1e-2, "atol": 1e-2}
    torch.testing.assert_close(TRITON_KERNELS.silu_mul(gate_up), TORCH_KERNELS.silu_mul(gate_up), **tol)


def test_rope_in_place_on_a_strided_view():
    gen = torch.Generator().manual_seed(2)
    num_q, num_kv, head_dim, num_positions = 4, 2, 32, 50
    qkv = torch.randn(6, num_q + 2 * num_kv, head_dim, generator=gen).to(DEVICE)  # [T, heads, D]
    angles = torch.rand(num_positions, head_dim // 2, generator=gen).to(DEVICE) * 6  # [P, D/2]
    cos, sin = angles.cos(), angles.sin()
    positions = torch.tensor([0, 3, 49, 7, 7, 12], device=DEVICE)
    expected = qkv.clone()
    TORCH_KERNELS.apply_rope_(
        expected[:, : num_q + num_kv], TORCH_KERNELS.rope_tables(cos, sin, positions, qkv.dtype)
    )
    TRITON_KERNELS.apply_rope_(qkv[:, : num_q + num_kv], RopeTables(positions, cos, sin))
    torch.testing.assert_close(qkv, expected, rtol=1e-5, atol=1e-5)
    assert torch.equal(qkv[:, num_q + num_kv :], expected[:, num_q + num_kv :])  # values untouched


@pytest.fixture
def triton_kernels(monkeypatch):
    monkeypatch.setenv("WEFT_KERNELS", "triton")


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_model_logits_match_transformers(checkpoint_factory, triton_kernels, arch):
    """The whole model on the Triton kernel set: prompts of different lengths in one step."""
    path = checkpoint_factory(arch)
    reference = transformers.AutoModelForCausalLM.from_pretrained(path).eval()
    llm = LLM(str(path), show_progress=False, device=DEVICE, dtype="float32", max_logprobs=384)
    assert llm.engine.runner.model.kernels is TRITON_KERNELS
    prompts = [[5, 17, 42, 99, 100, 7, 8, 250, 31, 64, 12, 77, 300, 2, 9, 1, 44, 45], [11, 12, 13], [3]]
    params = SamplingParams(max_tokens=1, temperature=0, logprobs=384)
    for prompt, out in zip(prompts, llm.generate(prompts, params, use_tqdm=False), strict=True):
        with torch.no_grad():
            expected = torch.log_softmax(reference(torch.tensor([prompt])).logits[0, -1].float(), dim=-1)
        actual = torch.tensor([out.outputs[0].logprobs[0][i].logprob for i in range(expected.shape[0])])
        torch.testing.assert_close(actual, expected, rtol=1e-4, atol=1e-4)


def test_engine_greedy_equals_torch_kernels(checkpoint_factory, monkeypatch):
    """Chunked prefill, a prefix-cache hit, n > 1 forks and decode, on both kernel sets."""
    path = checkpoint_factory("llama")
    prompts = [list(range(5, 45)), [*range(5, 45), 9, 8], [3, 4, 5]]
    params = [
        SamplingParams(max_tokens=8, temperature=0),
        SamplingParams(max_tokens=8, temperature=0),
        SamplingParams(max_tokens=8, n=2, temperature=0.8, seed=3),
    ]
    results = []
    for choice in ("torch", "triton"):
        monkeypatch.setenv("WEFT_KERNELS", choice)
        llm = LLM(str(path), show_progress=False, device=DEVICE, dtype="float32", max_num_batched_tokens=24)
        outs = llm.generate(prompts, params, use_tqdm=False)
        results.append([[c.token_ids for c in o.outputs] for o in outs])
        assert llm.stats()["prefix_cache_hit_tokens"] > 0
        assert llm.stats()["kv_blocks_used"] == 0
    assert results[0] == results[1]


def test_kernel_choice_is_validated(monkeypatch):
    from weft.config import ConfigError
    from weft.engine.loading import kernels_for

    monkeypatch.setenv("WEFT_KERNELS", "cuda-please")
    with pytest.raises(ConfigError, match="WEFT_KERNELS"):
        kernels_for(torch.device("cpu"))
    monkeypatch.setenv("WEFT_KERNELS", "torch")
    assert kernels_for(torch.device("cpu")) is not TRITON_KERNELS
    monkeypatch.setenv("WEFT_KERNELS", "triton")
    if os.environ.get("TRITON_INTERPRET") == "1":  # set by conftest where there is no GPU
        assert kernels_for(torch.device("cpu")) is TRITON_KERNELS
    else:  # a GPU machine: Triton compiles for it, and CPU tensors are refused with the way out
        with pytest.raises(ConfigError, match="TRITON_INTERPRET=1"):
            kernels_for(torch.device("cpu"))
    if not torch.cuda.is_available():
        monkeypatch.setenv("TRITON_INTERPRET", "0")
        with pytest.raises(ConfigError, match="TRITON_INTERPRET=1"):
            kernels_for(torch.device("cpu"))


@pytest.mark.parametrize("splits", [2, 4, 16])
@pytest.mark.parametrize("gqa", [1, 4])
def test_split_decode_attention_matches_sdpa(splits, gqa):
    """Flash-decoding: each context cut into `splits` shares of whole blocks (some empty where the
    context is short), merged by their softmax sums, equals SDPA over the whole context."""
    from weft.cuda.attention import split_decode_attention

    context_lens, block_size, num_kv_heads, head_dim = [1, 5, 16, 17, 100, 300], 16, 2, 64
    tables, num_blocks = random_step([1] * len(context_lens), context_lens, block_size, seed=splits)
    gen = torch.Generator().manual_seed(splits * 10 + gqa)
    cache = torch.randn(num_blocks, block_size, 2, num_kv_heads, head_dim, generator=gen).to(DEVICE)
    q = torch.randn(len(context_lens), gqa * num_kv_heads, head_dim, generator=gen).to(DEVICE)
    meta, _ = build_attention_metadata(
        [1] * len(context_lens), context_lens, tables, block_size, DEVICE, 1, True
    )
    assert meta.ragged is not None
    split = split_decode_attention(q, cache, meta.ragged, head_dim**-0.5, splits)
    meta, _ = build_attention_metadata([1] * len(context_lens), context_lens, tables, block_size, DEVICE)
    kv = cache.view(-1, 2, num_kv_heads, head_dim)[meta.slot_mapping]  # the step's own K/V, unchanged
    expected = paged_attention(q, kv, cache.clone(), meta, head_dim**-0.5, TORCH_KERNELS)
    torch.testing.assert_close(split.view(len(context_lens), -1), expected, rtol=1e-5, atol=1e-5)


def test_decode_steps_split_contexts_only_while_the_gpu_would_idle():
    from weft.cuda.attention import MAX_SPLITS, decode_splits

    cuda = torch.device("cuda")
    sms = torch.cuda.get_device_properties(cuda).multi_processor_count if torch.cuda.is_available() else None
    cpu = torch.device("cpu")  # as a GPU of 2 multiprocessors
    assert decode_splits(1, 1, cpu) == 4 and decode_splits(1, 2, cpu) == 2 and decode_splits(2, 2, cpu) == 1
    assert decode_splits(64, 8, cpu) == 1
    if sms is not None:
        assert decode_splits(1, 8, cuda) == min(MAX_SPLITS, 1 << (-(-2 * sms // 8) - 1).bit_length())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rope_and_kv_write_in_one_launch_match_the_two_steps(dtype):
    """`rope_write_kv_`: q and k rotated in place, k and v at their slots, as the torch kernel set's
    rotation followed by its scatter computes them, within rounding (float32: the products may
    contract into fused multiply-adds; bfloat16: torch rounds each product, the kernel the result)."""
    num_heads, num_kv, head_dim, positions = 4, 2, 64, torch.tensor([0, 7, 130, 3])
    gen = torch.Generator().manual_seed(5)
    qkv = torch.randn(4, num_heads + 2 * num_kv, head_dim, generator=gen).to(DEVICE, dtype)
    slots = torch.tensor([5, 40, 17, 63], device=DEVICE)
    inv_freq = 1.0 / (10000 ** (torch.arange(0, head_dim, 2) / head_dim))
    angles = torch.outer(torch.arange(256).float(), inv_freq)  # [P, D/2]
    cos, sin, positions = angles.cos().to(DEVICE), angles.sin().to(DEVICE), positions.to(DEVICE)
    outs = []
    for kernels in (TRITON_KERNELS, TORCH_KERNELS):
        cache = torch.zeros(4, 16, 2, num_kv, head_dim, device=DEVICE, dtype=dtype)
        rows = qkv.clone()
        kernels.rope_write_kv_(rows, num_heads, kernels.rope_tables(cos, sin, positions, dtype), cache, slots)
        outs.append((rows, cache))
    tol = 1e-5 if dtype == torch.float32 else 5e-2
    torch.testing.assert_close(outs[0][0], outs[1][0], rtol=tol, atol=tol)
    torch.testing.assert_close(outs[0][1], outs[1][1], rtol=tol, atol=tol)
    assert outs[0][1].abs().sum() > 0 and outs[0][1][0, 5].abs().sum() > 0  # slot 5: block 0, offset 5
