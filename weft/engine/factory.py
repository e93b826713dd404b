"""One way to build an engine, for `LLM`, the benchmarks, the tests and the server alike.

`build_engine(EngineArgs(...))`, in order:
  1. resolve the checkpoint: the default model, a local directory, or a Hugging Face model id;
  2. read config.json (with the end-of-sequence tokens of generation_config.json) and the tokenizer;
  3. settle `max_model_len` against the model's maximum;
  4. load the model on its device in its dtype;
  5. size the KV cache from the memory left after loading;
  6. build the validated configs, then the engine (KV manager, scheduler, runner, sampler).
"""

from __future__ import annotations

import json
import os
import sys
import warnings
from dataclasses import fields
from pathlib import Path
from typing import Any

import torch

from weft.config import (
    CacheConfig,
    ConfigError,
    EngineConfig,
    ModelConfig,
    SchedulerConfig,
    SpeculativeConfig,
    resolve_device,
)
from weft.engine.args import EngineArgs
from weft.engine.default_model import default_model_path
from weft.engine.engine import LLMEngine, Ranks
from weft.engine.graphs import cuda_capture
from weft.engine.heap import keep_freed_memory, settle_heap
from weft.engine.kv_pools import KVPools, has_window_pool, split_pools
from weft.engine.loading import CPU_KV_BUDGET, load
from weft.engine.rank import worker_main
from weft.engine.runner import ModelRunner
from weft.kv_format import kv_dtype_name
from weft.model.gguf_checkpoint import GgufCheckpoint, is_gguf
from weft.model.loader import load_config, open_source
from weft.parallel.group import TensorParallel, free_port
from weft.parallel.shard import Shard
from weft.parallel.workers import RankSpec, Workers
from weft.tokenizer import Tokenizer

CHECKPOINT_PATTERNS = ["*.json", "*.safetensors", "tokenizer.model", "*.jinja"]


def speculative_config(value: dict[str, Any] | str | None) -> SpeculativeConfig | None:
    """`speculative_config` as `LLM` takes it (a dict) or as the command line does (JSON text)."""
    if value is None:
        return None
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as exc:
            raise ValueError(f"speculative_config is not valid JSON: {exc}") from None
    if not isinstance(value, dict):
        raise ValueError(f"speculative_config must be a JSON object (a dict), got {type(value).__name__}")
    return SpeculativeConfig.of(value)


def build_engine(args: EngineArgs) -> LLMEngine:
    speculative = speculative_config(args.speculative_config)  # a bad option fails before loading
    path = resolve_model_path(args.model)
    device = resolve_device(args.device)
    ranks = start_ranks(args, path, device)  # tensor parallel: ranks 1..N-1 load their parts meanwhile
    try:
        engine = _build(args, path, device, ranks, speculative)
    except BaseException:
        if ranks is not None:
            ranks.workers.stop()  # (they may be waiting for what rank 0 failed to send)
        raise
    settle_heap()  # the collector out of the step's way (weft/engine/heap.py)
    if device.type == "cpu":
        keep_freed_memory()  # activations reuse the C heap from step to step (the same module)
    return engine


def _build(
    args: EngineArgs,
    path: Path,
    device: torch.device,
    ranks: Ranks | None,
    speculative: SpeculativeConfig | None,
) -> LLMEngine:
    """Steps 2-6, as rank 0 with `ranks`."""
    loaded = load(args, path, device, None if ranks is None else ranks.tp)
    kv_dtype = loaded.kv_dtype
    tokenizer = _load_tokenizer(loaded.source, args.tokenizer)
    max_num_batched_tokens = args.max_num_batched_tokens or max(2048, args.block_size)
    pools = _kv_pools(loaded.model.config, args, kv_dtype, device, loaded.max_len, max_num_batched_tokens)
    cache = CacheConfig(
        block_size=args.block_size,
        num_blocks=pools.num_blocks,
        enable_prefix_caching=args.enable_prefix_caching,
        dtype=kv_dtype,
        window=pools.window,
        num_window_blocks=pools.num_window_blocks,
    )
    if args.show_progress:  # what runs the model, chosen once here
        info = loaded.kernels.describe(device, loaded.dtype, loaded.matmul)
        info["kv_cache"] = kv_dtype_name(kv_dtype)
        print(f"weft: {describe_kernels(info)}", file=sys.stderr, flush=True)
    scheduler = SchedulerConfig(args.max_num_seqs, max_num_batched_tokens, loaded.max_len)
    async_scheduling = device.type == "cuda" if args.async_scheduling is None else args.async_scheduling
    config = EngineConfig(
        loaded.config, cache, scheduler, device, loaded.activations, args.seed, args.max_logprobs,
        loaded.dtype, loaded.matmul, async_scheduling and ranks is None, speculative,
    )  # fmt: skip
    if ranks is not None:
        ranks.tp.send(cache)  # the other ranks size their KV caches the same (their parts of it)
    engine = LLMEngine(config, loaded.model, tokenizer, ranks)
    if device.type == "cuda" and not args.enforce_eager and ranks is None:
        _capture_graphs(engine, args.show_progress)
    return engine


def start_ranks(args: EngineArgs, path: Path, device: torch.device) -> Ranks | None:
    """With `tensor_parallel_size` N > 1: check that the model divides and the machine has N
    devices, start ranks 1..N-1 (each loads its part) and join them as rank 0; None for N = 1."""
    n = args.tensor_parallel_size
    if not isinstance(n, int) or isinstance(n, bool) or n < 1:
        raise ConfigError(f"tensor_parallel_size must be an integer >= 1, got {n!r}")
    if n == 1:
        return None
    if device.type == "cuda":
        available = torch.cuda.device_count()
        if n > available:
            raise ConfigError(
                f"tensor_parallel_size={n} needs {n} GPUs, one per rank; this machine has {available}"
            )
    elif n > (os.cpu_count() or 1):
        raise ConfigError(
            f"tensor_parallel_size={n} needs a CPU core per rank at least; this machine has {os.cpu_count()}"
        )
    Shard(0, n).check(_full_config(path))
    threads = max(1, torch.get_num_threads() // n) if device.type == "cpu" else torch.get_num_threads()
    port = free_port()
    options = {f.name: getattr(args, f.name) for f in fields(args)}
    specs = [
        RankSpec(rank, n, port, f"cuda:{rank}" if device.type == "cuda" else "cpu", threads, path, options)
        for rank in range(1, n)
    ]
    workers = Workers.start(specs, worker_main)
    try:
        torch.set_num_threads(threads)  # this process is rank 0: its share of the cores
        rank0 = torch.device("cuda:0") if device.type == "cuda" else device
        tp = TensorParallel.connect(0, n, port, rank0, failure=workers.failure)
    except BaseException:
        workers.stop()
        raise
    return Ranks(tp, workers)


def _full_config(path: Path) -> ModelConfig:
    return load_config(open_source(path))


def _capture_graphs(engine: LLMEngine, progress: bool) -> None:
    """Capture the decode steps as CUDA graphs; a failure leaves every step eager, with a warning."""
    scheduler = engine.config.scheduler
    try:
        report = engine.runner.capture_graphs(
            scheduler.max_model_len, scheduler.max_num_seqs, cuda_capture, progress
        )
    except (RuntimeError, torch.cuda.OutOfMemoryError) as exc:  # runner.graphs stays None
        warnings.warn(f"CUDA graphs are off, every step runs eagerly: {exc}", stacklevel=3)
        return
    if report is not None and progress:
        print(
            f"weft: captured decode graphs for batch sizes {report.sizes[0]}..{report.sizes[-1]} "
            f"({len(report.sizes)} graphs) in {report.seconds:.1f} s, {report.memory_bytes / 2**20:.0f} MiB",
            file=sys.stderr,
            flush=True,
        )


def describe_kernels(info: dict[str, str]) -> str:
    """One line: 'bfloat16 weights, float32 activations, matmul: bfloat16 products ...; linear: ...;
    kernels: native-cpu, ISA path avx512_bf16 (avx512f ...)'."""
    isa = f", ISA path {info['isa']}" if "isa" in info else ""
    cpu = f" ({info['cpu']})" if "cpu" in info else ""
    kv = f", {info['kv_cache']} KV cache" if "kv_cache" in info else ""
    return (
        f"{info['weights']} weights, {info['activations']} activations{kv}, matmul: {info['matmul']}; "
        f"linear: {info['linear']}; kernels: {info['kernels']}{isa}{cpu}"
    )


def resolve_model_path(model: str | Path | None) -> Path:
    """A local checkpoint directory for `model`: None means the default model (`default_model_path`:
    SmolLM2-135M-Instruct where it is installed, else the bundled model); a path is used as
    it is; anything else is a Hugging Face model id, downloaded when online."""
    if model is None:
        return default_model_path()
    path = Path(model).expanduser()
    if path.is_dir() or is_gguf(path):
        return path
    if path.exists() or str(model).startswith((".", "/", "~")):
        raise ConfigError(f"{path}: neither a checkpoint directory nor a GGUF file")
    return _download(str(model))


def _download(model_id: str) -> Path:
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HFValidationError

    try:
        return Path(snapshot_download(model_id, allow_patterns=CHECKPOINT_PATTERNS))
    except HFValidationError:
        raise ConfigError(f"{model_id!r} is neither a local directory nor a valid model id") from None
    except Exception as exc:
        offline = os.environ.get("HF_HUB_OFFLINE") == "1"
        hint = "offline (HF_HUB_OFFLINE=1)" if offline else "unreachable or unknown"
        raise ConfigError(
            f"{model_id!r} is not a local directory, and the Hugging Face hub is {hint} "
            f"({type(exc).__name__}); "
            "pass the path of a downloaded checkpoint directory instead"
        ) from None


def _load_tokenizer(source: Path | GgufCheckpoint, tokenizer: str | Path | None) -> Tokenizer:
    """The tokenizer of `tokenizer` (a directory) if given, else the checkpoint's own."""
    if tokenizer is not None:
        return Tokenizer.from_dir(Path(tokenizer).expanduser())
    if isinstance(source, GgufCheckpoint):
        return Tokenizer.from_gguf(source.metadata, str(source.path))
    return Tokenizer.from_dir(source)


def _kv_pools(
    config: ModelConfig,
    args: EngineArgs,
    kv_dtype: torch.dtype,
    device: torch.device,
    max_len: int,
    max_num_batched_tokens: int,
) -> KVPools:
    """The KV blocks: `num_kv_blocks`, or as many as the memory budget holds (default: 2 GiB on
    CPU, half of what is free on CUDA once the model is loaded) but no more than every sequence at
    full length needs and at least one full-length sequence; with the sliding-window layers' own
    pool where the model has a window shorter than the context (`weft/engine/kv_pools.py`)."""
    budget = None
    if args.num_kv_blocks is None:
        if args.kv_cache_memory_gb is not None:
            budget = int(args.kv_cache_memory_gb * 1024**3)
        elif device.type == "cuda":
            budget = torch.cuda.mem_get_info(device)[0] // 2
        else:
            budget = CPU_KV_BUDGET
    if has_window_pool(config, max_len, args.window_kv_pool):
        layer_block = ModelRunner.kv_bytes_per_block(config, args.block_size, kv_dtype) // config.num_layers
        return split_pools(
            config, args.block_size, layer_block, budget, args.num_kv_blocks, max_len, args.max_num_seqs,
            max_num_batched_tokens,
        )  # fmt: skip
    if args.num_kv_blocks is not None:
        return KVPools(args.num_kv_blocks)
    assert budget is not None
    per_block = ModelRunner.kv_bytes_per_block(config, args.block_size, kv_dtype)
    blocks_per_seq = -(-max_len // args.block_size)
    return KVPools(max(blocks_per_seq + 1, min(budget // per_block, blocks_per_seq * args.max_num_seqs)))
