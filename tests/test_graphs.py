"""Decode-step graphs (weft/engine/graphs.py): static buffers, padding rows and the choice of size
tested on CPU with a capture that replays eagerly (the Triton kernels in Triton's interpreter), and
the real CUDA graphs against eager where there is a GPU."""

from __future__ import annotations

import pytest
import torch

from weft import LLM, SamplingParams
from weft.engine import factory
from weft.engine.graphs import capture_sizes, eager_capture

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
PROMPTS = [[5, 17, 42, 99, 100, 7], [11, 12, 13], [3], list(range(20, 30)), [200, 201, 202, 203, 204]]


def test_capture_sizes():
    assert capture_sizes(64) == [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64]
    assert capture_sizes(20) == [1, 2, 4, 8, 16, 20]
    assert capture_sizes(5) == [1, 2, 4, 5]
    assert capture_sizes(1) == [1]


def mixed_params() -> list[SamplingParams]:
    """Different lengths, so the decode batch shrinks through every size (5, 4, 3, 2, 1 rows: padded
    to 6, 4, 4, 2, 1); greedy and seeded."""
    return [
        SamplingParams(max_tokens=2 + i, temperature=0.0 if i % 2 else 0.9, seed=i)
        for i in range(len(PROMPTS))
    ]


def triton_llm(path, monkeypatch, **options) -> LLM:
    monkeypatch.setenv("WEFT_KERNELS", "triton")
    return LLM(str(path), show_progress=False, device=DEVICE, dtype="float32", enforce_eager=True, **options)


def count_replays(llm: LLM) -> dict[int, int]:
    graphs = llm.engine.runner.graphs
    assert graphs is not None
    counts = dict.fromkeys(graphs.replays, 0)
    for size, replay in list(graphs.replays.items()):

        def counted(size=size, replay=replay):
            counts[size] += 1
            return replay()

        graphs.replays[size] = counted
    return counts


def test_replayed_decode_steps_equal_eager(checkpoint_factory, monkeypatch):
    path = checkpoint_factory("llama")
    eager = triton_llm(path, monkeypatch, max_num_seqs=6)
    expected = eager.generate(PROMPTS, mixed_params(), use_tqdm=False)
    llm = triton_llm(path, monkeypatch, max_num_seqs=6)
    config = llm.config.scheduler
    report = llm.engine.runner.capture_graphs(config.max_model_len, config.max_num_seqs, eager_capture)
    assert report is not None and report.sizes == [1, 2, 4, 6]
    counts = count_replays(llm)
    outputs = llm.generate(PROMPTS, mixed_params(), use_tqdm=False)
    for got, want in zip(outputs, expected, strict=True):
        assert got.outputs[0].token_ids == want.outputs[0].token_ids
    assert counts[6] > 0 and counts[4] > 0 and counts[2] > 0 and counts[1] > 0  # padded rows too
    assert llm.stats()["kv_blocks_used"] == 0


def test_prompt_steps_and_oversized_batches_run_eagerly(checkpoint_factory, monkeypatch):
    path = checkpoint_factory("llama")
    llm = triton_llm(path, monkeypatch, max_num_seqs=8)
    llm.engine.runner.capture_graphs(llm.config.scheduler.max_model_len, 2, eager_capture)  # sizes 1, 2
    counts = count_replays(llm)
    params = SamplingParams(max_tokens=3, temperature=0)
    expected = triton_llm(path, monkeypatch).generate(PROMPTS, params, use_tqdm=False)
    outputs = llm.generate(PROMPTS, params, use_tqdm=False)  # 5 rows: eager until only 2 are left
    assert [o.outputs[0].token_ids for o in outputs] == [o.outputs[0].token_ids for o in expected]
    assert counts == {1: 0, 2: 0}  # all five finish together: no decode step had <= 2 rows
    single = llm.generate([PROMPTS[0]], params, use_tqdm=False)
    assert single[0].outputs[0].token_ids == expected[0].outputs[0].token_ids
    assert counts[1] == 2  # the prompt step eager, then two decode steps replayed


def test_a_replay_that_differs_turns_graphs_off(checkpoint_factory, monkeypatch):
    path = checkpoint_factory("llama")
    llm = triton_llm(path, monkeypatch, max_num_seqs=4)

    def broken_capture(forward, pool):
        return lambda: forward() + 1.0

    monkeypatch.setattr(factory, "cuda_capture", broken_capture)
    with pytest.warns(UserWarning, match="CUDA graphs are off.*replays differently"):
        factory._capture_graphs(llm.engine, progress=False)
    assert llm.engine.runner.graphs is None
    out = llm.generate([PROMPTS[0]], SamplingParams(max_tokens=3, temperature=0), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 3


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA GPU")
@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_cuda_graphs_equal_eager(checkpoint_factory, arch):
    """Every captured size: identical greedy tokens, logprobs within 1e-5 relative, in float32."""
    path = checkpoint_factory(arch)
    params = SamplingParams(max_tokens=6, temperature=0, logprobs=5)
    results = []
    for eager in (True, False):
        llm = LLM(str(path), show_progress=False, device="cuda", dtype="float32", max_num_seqs=8,
                  enforce_eager=eager)  # fmt: skip
        assert (llm.engine.runner.graphs is None) == eager
        batches = [(PROMPTS * 2)[:size] for size in [*capture_sizes(8), 3]]  # every size, one padded
        results.append([llm.generate(batch, params, use_tqdm=False) for batch in batches])
    for eager_outs, graph_outs in zip(*results, strict=True):
        for want, got in zip(eager_outs, graph_outs, strict=True):
            assert got.outputs[0].token_ids == want.outputs[0].token_ids
            for got_pos, want_pos in zip(got.outputs[0].logprobs, want.outputs[0].logprobs, strict=True):
                for token_id, logprob in want_pos.items():
                    assert got_pos[token_id].logprob == pytest.approx(logprob.logprob, rel=1e-5, abs=1e-6)
