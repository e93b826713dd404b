"""One way to build an engine, for `LLM`, the benchmarks, the tests and the server alike.

`build_engine(EngineArgs(...))`, in order:
  1. resolve the checkpoint: the bundled model, a local directory, or a Hugging Face model id;
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
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from weft.config import (
    CacheConfig,
    ConfigError,
    EngineConfig,
    KernelChoice,
    ModelConfig,
    SchedulerConfig,
    read_optional_json,
    resolve_device,
    resolve_dtype,
)
from weft.engine.args import EngineArgs
from weft.engine.engine import LLMEngine
from weft.engine.graphs import cuda_capture
from weft.engine.heap import settle_heap
from weft.engine.runner import ModelRunner
from weft.kernels import NATIVE_CPU_KERNELS, TORCH_KERNELS, TorchKernels, triton_available
from weft.model.gguf_checkpoint import GgufCheckpoint, is_gguf
from weft.model.loader import load_config, load_model, open_source
from weft.model.quantize import check_quantization
from weft.native import use_kernels
from weft.speculative.config import SpeculativeConfig
from weft.tokenizer import Tokenizer

DEFAULT_MAX_MODEL_LEN = 8192
CHECKPOINT_PATTERNS = ["*.json", "*.safetensors", "tokenizer.model", "*.jinja"]


def kernels_for(device: torch.device) -> TorchKernels:
    """The kernel set for `device`, chosen here where the device is (on CPU this builds weft's
    kernels on first use, so the first step does not)."""
    choice = KernelChoice.from_env()
    if choice.triton is True and device.type != "cuda" and not choice.interpreted:
        raise ConfigError(
            f"WEFT_KERNELS=triton on {device.type}: Triton compiles for CUDA GPUs only; set "
            "TRITON_INTERPRET=1 to run its kernels in the interpreter (slow; for tests) or unset WEFT_KERNELS"
        )
    if choice.triton is True or (choice.triton is None and device.type == "cuda" and triton_available()):
        from weft.cuda.kernels import TRITON_KERNELS  # imports triton: only when chosen

        return TRITON_KERNELS
    return NATIVE_CPU_KERNELS if use_kernels(device) else TORCH_KERNELS


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
    source = open_source(path)  # the directory, or the GGUF file opened once
    model_config = load_config(source)
    if not isinstance(source, GgufCheckpoint):
        model_config = _with_generation_eos(model_config, path)
    kernels = kernels_for(device)
    dtype = resolve_dtype(
        args.dtype,
        device,
        model_config.checkpoint_dtype,
        kernels.packs_linear_weights(device, torch.bfloat16),
    )
    quantization = check_quantization(args.quantization)
    quantized = (isinstance(source, GgufCheckpoint) and source.quantized) or quantization is not None
    matmul = kernels.matmul_dtype(device, dtype, args.matmul_precision, quantized)
    tokenizer = _load_tokenizer(source, args.tokenizer)
    max_len = _max_model_len(args.max_model_len, model_config)
    model = load_model(
        source,
        model_config,
        dtype,
        device,
        max_len,
        args.show_progress,
        matmul,
        quantization,
        kernels=kernels,
    )
    if args.show_progress:  # what runs the model, chosen once here
        info = kernels.describe(device, dtype, matmul)
        print(f"weft: {describe_kernels(info)}", file=sys.stderr, flush=True)
    activations = kernels.activation_dtype(device, dtype)
    cache = CacheConfig(
        block_size=args.block_size,
        num_blocks=args.num_kv_blocks
        or _default_num_blocks(model_config, args, activations, device, max_len),
        enable_prefix_caching=args.enable_prefix_caching,
    )
    scheduler = SchedulerConfig(
        args.max_num_seqs, args.max_num_batched_tokens or max(2048, args.block_size), max_len
    )
    async_scheduling = device.type == "cuda" if args.async_scheduling is None else args.async_scheduling
    config = EngineConfig(
        model_config, cache, scheduler, device, activations, args.seed, args.max_logprobs, dtype,
        matmul, async_scheduling, speculative,
    )  # fmt: skip
    engine = LLMEngine(config, model, tokenizer)
    if device.type == "cuda" and not args.enforce_eager:
        _capture_graphs(engine, args.show_progress)
    settle_heap()  # the collector out of the step's way (weft/engine/heap.py)
    return engine


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
    return (
        f"{info['weights']} weights, {info['activations']} activations, matmul: {info['matmul']}; "
        f"linear: {info['linear']}; kernels: {info['kernels']}{isa}{cpu}"
    )


def default_model_path() -> Path:
    """The directory of the small model bundled with weft (trained on Tiny Shakespeare)."""
    return Path(__file__).resolve().parents[1] / "default_model"


def resolve_model_path(model: str | Path | None) -> Path:
    """A local checkpoint directory for `model`: None means the bundled model; a path is used as
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


def _with_generation_eos(config: ModelConfig, model_dir: Path) -> ModelConfig:
    """generation_config.json may name more end-of-sequence tokens than config.json."""
    gen = read_optional_json(model_dir / "generation_config.json")
    eos = gen.get("eos_token_id")
    extra = tuple(eos) if isinstance(eos, list) else ((eos,) if isinstance(eos, int) else ())
    merged = tuple(dict.fromkeys(config.eos_token_ids + extra))
    return replace(config, eos_token_ids=merged)


def _max_model_len(requested: int | None, config: ModelConfig) -> int:
    if requested is not None and requested > config.max_position_embeddings:
        raise ConfigError(
            f"max_model_len={requested} exceeds the model's max_position_embeddings "
            f"({config.max_position_embeddings})"
        )
    return min(requested or DEFAULT_MAX_MODEL_LEN, config.max_position_embeddings)


def _default_num_blocks(
    config: ModelConfig, args: EngineArgs, dtype: torch.dtype, device: torch.device, max_len: int
) -> int:
    """As many blocks as the memory budget holds (default: 2 GiB on CPU, half of what is free on
    CUDA once the model is loaded), but no more than every sequence at full length needs, and at
    least one full-length sequence."""
    per_block = ModelRunner.kv_bytes_per_block(config, args.block_size, dtype)
    if args.kv_cache_memory_gb is not None:
        budget = int(args.kv_cache_memory_gb * 1024**3)
    elif device.type == "cuda":
        budget = torch.cuda.mem_get_info(device)[0] // 2
    else:
        budget = 2 * 1024**3
    blocks_per_seq = -(-max_len // args.block_size)
    return max(blocks_per_seq + 1, min(budget // per_block, blocks_per_seq * args.max_num_seqs))
