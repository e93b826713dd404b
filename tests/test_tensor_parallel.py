"""Tensor parallelism at world size 2 on CPU (gloo over loopback): each sharded layer against its
unsharded reference, then whole engines against one rank: prefill logprobs within 1e-5 in float32,
greedy and seeded tokens identical, with grammars, forks, beams, prefix caching and preemption;
and a rank killed mid-request fails its requests clearly and leaves no process behind."""

from __future__ import annotations

import os
import re
import signal
import threading
from pathlib import Path

import pytest
import torch

from weft import LLM, BeamSearchParams, SamplingParams, bundled_model_path
from weft.config import ConfigError
from weft.engine.args import EngineArgs
from weft.engine.loading import kernels_for, load
from weft.model.attention import PagedAttention
from weft.parallel.group import TensorParallel, free_port
from weft.parallel.shard import Shard

ON_CPU = {"show_progress": False, "device": "cpu", "dtype": "float32"}
PROMPTS = ["First Citizen: Before we proceed", "Speak, speak.", "You are all resolved rather to die"]


def pair(path: Path, **options) -> tuple[LLM, LLM]:
    return LLM(str(path), **ON_CPU, **options), LLM(str(path), **ON_CPU, tensor_parallel_size=2, **options)


def positions_close(a, b, tol: float = 1e-5) -> None:
    """Two lists of per-position logprob dicts: the same tokens, logprobs within `tol`."""
    assert len(a) == len(b)
    for x, y in zip(a, b, strict=True):
        if x is None:
            assert y is None
            continue
        assert set(x) == set(y)
        for token in x:
            assert abs(x[token].logprob - y[token].logprob) < tol


# ---- each sharded layer against its unsharded reference, two ranks in two threads -----------


def _both_ranks(fn):
    """Run fn(tp) as rank 0 and rank 1 of a real gloo group, in two threads; their results."""
    port, results, errors = free_port(), [None, None], []

    def run(rank: int) -> None:
        try:
            tp = TensorParallel.connect(rank, 2, port, torch.device("cpu"), timeout_s=60)
            results[rank] = fn(tp)
        except Exception as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(rank,)) for rank in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors, errors
    return results


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "llama-untied"])
def test_each_sharded_layer_computes_its_unsharded_reference(checkpoint_factory, arch):
    """The vocabulary-parallel embedding, the column-parallel q/k/v and gate/up with the
    row-parallel o and down projections (one all-reduce each), the attention of each rank's KV
    heads, and the gathered lm_head: each layer's output on two ranks equals the whole model's."""
    path = checkpoint_factory(arch)
    args = EngineArgs(model=str(path), dtype="float32", device="cpu", show_progress=False)
    full = load(args, path, torch.device("cpu")).model
    ids = torch.tensor([5, 17, 42, 99, 100, 7, 383, 0])  # both vocabulary halves
    x = torch.randn(len(ids), full.config.hidden_size, generator=torch.Generator().manual_seed(0))

    def layers(model):
        layer = model.layers[0]
        kv_cache = torch.zeros(4, 16, 2, model.config.num_kv_heads, model.config.head_dim)
        meta, positions = PagedAttention(
            kernels_for(torch.device("cpu")), model.config.head_dim
        ).build_metadata([len(ids)], [len(ids)], [[1]], 16, torch.device("cpu"))
        rope = model.rotary.tables(positions, torch.float32)
        return {
            "embedding": model._embed(ids),
            "attention": layer.attn(x.clone(), rope, kv_cache, meta),
            "mlp": layer.mlp(x.clone()),
            "logits": model.compute_logits(x.clone()),
        }

    reference = layers(full)
    ranks = _both_ranks(lambda tp: layers(load(args, path, torch.device("cpu"), tp).model))
    for name, want in reference.items():
        got = ranks[0][name]
        assert got.shape == want.shape, name
        assert torch.allclose(got, want, atol=1e-5, rtol=1e-5), (name, (got - want).abs().max())
        if name != "logits":  # the sums reach every rank; the logits only rank 0
            assert torch.equal(ranks[1][name], got), name


def test_the_shard_cuts_every_tensor_by_heads_columns_and_vocabulary(checkpoint_factory):
    from weft.config import ModelConfig

    config = ModelConfig.from_file(checkpoint_factory("llama") / "config.json")
    d = config.head_dim
    q = torch.arange(config.num_heads * d * 3, dtype=torch.float32).view(config.num_heads * d, 3)
    for rank in (0, 1):
        shard = Shard(rank, 2)
        part = shard.tensor("model.layers.0.self_attn.q_proj.weight", q, config)
        assert torch.equal(part, q[rank * 2 * d : (rank + 1) * 2 * d])
        o = torch.randn(5, config.num_heads * d)
        assert torch.equal(
            shard.tensor("model.layers.3.self_attn.o_proj.weight", o, config),
            o[:, rank * 2 * d :][:, : 2 * d],
        )
        bias = torch.ones(5)
        assert torch.equal(
            shard.tensor("model.layers.0.self_attn.o_proj.bias", bias, config), bias * (rank == 0)
        )
        table = torch.randn(config.vocab_size, 4)
        half = config.vocab_size // 2
        assert torch.equal(
            shard.tensor("model.embed_tokens.weight", table, config), table[rank * half : (rank + 1) * half]
        )
        norm = torch.randn(config.hidden_size)
        assert shard.tensor("model.layers.1.input_layernorm.weight", norm, config) is norm
        assert shard.config(config).num_kv_heads == config.num_kv_heads // 2


def test_olmo2_is_refused_with_the_reason(checkpoint_factory):
    """OLMo 2's q and k norms span every head, which the ranks split: a clear error, not wrong numbers."""
    from weft.config import ConfigError
    from weft.model.loader import load_config
    from weft.parallel.shard import Shard

    config = load_config(checkpoint_factory("olmo2"))
    with pytest.raises(ConfigError, match="OLMo 2"):
        Shard(0, 2).check(config)


# ---- engines at world size 2 against one rank ----------------------------------------------


@pytest.mark.parametrize("arch", ["llama-untied", "qwen2", "qwen3", "granite", "gemma3", "bundled"])
def test_two_ranks_compute_what_one_rank_does(checkpoint_factory, arch):
    """Every way a layer is split, on tiny checkpoints, and the bundled model: prompt logprobs,
    greedy tokens and their logprobs, and seeded samples on two ranks as on one. (The bundled model
    is a Llama with tied embeddings, `llama-untied` one without; Mistral without a window is the
    same layers; Llama 3's rope scaling changes no shard: each rank computes the same tables.)"""
    one, two = pair(bundled_model_path() if arch == "bundled" else checkpoint_factory(arch))
    try:
        exact = SamplingParams(temperature=0, max_tokens=32, logprobs=4, prompt_logprobs=4, ignore_eos=True)
        a, b = one.generate(PROMPTS, exact), two.generate(PROMPTS, exact)
        for x, y in zip(a, b, strict=True):
            positions_close(x.prompt_logprobs, y.prompt_logprobs)
            assert x.outputs[0].token_ids == y.outputs[0].token_ids
            positions_close(x.outputs[0].logprobs, y.outputs[0].logprobs)
        seeded = SamplingParams(temperature=1.0, top_p=0.9, seed=7, max_tokens=32)
        assert [o.outputs[0].token_ids for o in one.generate(PROMPTS, seeded)] == [
            o.outputs[0].token_ids for o in two.generate(PROMPTS, seeded)
        ]
    finally:
        two.engine.shutdown()


def test_grammars_forks_beams_prefix_caching_and_preemption_on_two_ranks(tiny_llama):
    """A mixed batch on a KV cache small enough to preempt: the outputs of one rank, token for token."""
    one, two = pair(tiny_llama, num_kv_blocks=14, max_num_seqs=6, max_model_len=160)
    try:
        shared = "All: Speak, speak. You are all resolved rather to die than to famish? " * 2
        requests = [
            (shared + "First", SamplingParams(temperature=0.8, seed=1, max_tokens=24, n=3)),
            (shared + "Second", SamplingParams(temperature=0.8, seed=2, max_tokens=24, best_of=3, n=2)),
            ("Name:", SamplingParams(seed=3, max_tokens=20, regex="[a-z]{2,8}( [a-z]{2,8})*")),
            (
                "JSON:",
                SamplingParams(
                    temperature=0,
                    max_tokens=30,
                    json_schema={
                        "type": "object",
                        "properties": {"a": {"type": "integer"}},
                        "required": ["a"],
                    },
                ),
            ),
            (shared, SamplingParams(temperature=0, max_tokens=16, logprobs=2)),
        ]
        prompts, params = [p for p, _ in requests], [s for _, s in requests]
        a, b = one.generate(prompts, params), two.generate(prompts, params)
        for x, y in zip(a, b, strict=True):
            assert [c.token_ids for c in x.outputs] == [c.token_ids for c in y.outputs]
        beams = BeamSearchParams(beam_width=3, max_tokens=12)
        assert [s.token_ids for s in one.beam_search(["First Citizen:"], beams)[0].sequences] == [
            s.token_ids for s in two.beam_search(["First Citizen:"], beams)[0].sequences
        ]
        again = SamplingParams(temperature=0, max_tokens=8, logprobs=2)
        x = one.generate(shared + "Third", again)[0]
        two.generate(shared + "Third", again)
        y = two.generate(shared + "Third", again)[0]  # its prompt cached on both ranks by now
        assert x.outputs[0].token_ids == y.outputs[0].token_ids and y.num_cached_tokens > 0
        positions_close(x.outputs[0].logprobs, y.outputs[0].logprobs)
        stats = two.stats()
        assert stats["num_preemptions"] > 0 and stats["kv_blocks_used"] == 0
    finally:
        two.engine.shutdown()


def test_a_killed_rank_fails_its_requests_and_leaves_no_process(tiny_llama):
    two = LLM(str(tiny_llama), **ON_CPU, tensor_parallel_size=2)
    engine = two.engine
    assert engine.ranks is not None
    pids = engine.ranks.workers.pids
    engine.add_request("a", "Hello", SamplingParams(max_tokens=50, seed=1))
    engine.add_request("b", "World", SamplingParams(max_tokens=50, seed=2, n=2))
    for _ in range(3):
        engine.step()
    os.kill(pids[0], signal.SIGKILL)
    outputs = engine.step()
    assert sorted(o.request_id for o in outputs) == ["a", "b"]
    for out in outputs:
        assert out.finished
        for c in out.outputs:
            assert c.finish_reason == "error" and "rank 1 was killed by signal 9" in c.error
    assert engine.kv.num_used_blocks == 0 and not engine.has_unfinished_requests()
    with pytest.raises(RuntimeError, match="this engine has stopped: tensor-parallel rank 1"):
        engine.add_request("c", "x", SamplingParams())
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


def test_a_stopped_engine_leaves_no_process(tiny_llama):
    two = LLM(str(tiny_llama), **ON_CPU, tensor_parallel_size=2)
    assert two.engine.ranks is not None
    pids = two.engine.ranks.workers.pids
    assert two.generate("Hi", SamplingParams(max_tokens=4))[0].finished
    two.engine.shutdown()
    assert [p.exitcode for p in two.engine.ranks.workers.processes] == [0]
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


def test_what_does_not_divide_or_fit_is_a_clear_error(checkpoint_factory, tiny_llama):
    for overrides, named in [
        ({"hidden_size": 48, "num_attention_heads": 3, "num_key_value_heads": 3}, "num_attention_heads (3)"),
        ({"num_key_value_heads": 1}, "num_key_value_heads (1)"),
        ({"intermediate_size": 129}, "intermediate_size (129)"),
        ({"vocab_size": 385}, "vocab_size (385)"),
    ]:
        with pytest.raises(
            ConfigError, match=re.escape(f"tensor_parallel_size=2 does not divide the model's {named}")
        ):
            LLM(str(checkpoint_factory("llama", **overrides)), **ON_CPU, tensor_parallel_size=2)
    with pytest.raises(ConfigError, match="needs a CPU core per rank"):
        LLM(str(tiny_llama), **ON_CPU, tensor_parallel_size=(os.cpu_count() or 1) * 2)
    with pytest.raises(ConfigError, match="tensor_parallel_size must be an integer >= 1"):
        LLM(str(tiny_llama), **ON_CPU, tensor_parallel_size=0)


def test_exact_scoring_says_it_runs_on_one_rank(tiny_llama):
    two = LLM(str(tiny_llama), **ON_CPU, tensor_parallel_size=2)
    try:
        with pytest.raises(ValueError, match=r"exact scoring .* runs on one rank"):
            two.score("Hello", [" there", " world"])
    finally:
        two.engine.shutdown()
