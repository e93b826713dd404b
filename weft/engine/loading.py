"""Loading a model on its device: the configuration, the kernel set, the dtype and the weights,
settled the same way for an engine (`weft.engine.factory`) and for each tensor-parallel rank
(`weft.engine.rank`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from weft.config import (
    ConfigError,
    KernelChoice,
    ModelConfig,
    kv_cache_dtype,
    read_optional_json,
    resolve_dtype,
)
from weft.engine.args import EngineArgs
from weft.engine.fit import check_fits, experts_in_file, report_load
from weft.engine.kv_pools import bytes_per_token, has_window_pool
from weft.engine.runner import ModelRunner
from weft.kernels import NATIVE_CPU_KERNELS, TORCH_KERNELS, TorchKernels, triton_available
from weft.kv_format import Q8_0, Q8_ELEMENTS
from weft.model.gguf_checkpoint import GgufCheckpoint
from weft.model.llama import LlamaForCausalLM
from weft.model.loader import Source, load_config, load_model, open_source
from weft.model.quantize import check_quantization
from weft.model.quantized import FILE_KINDS
from weft.native import use_kernels
from weft.parallel.group import TensorParallel

DEFAULT_MAX_MODEL_LEN = 8192  # the least default context (a model's own maximum where it is less)
CPU_KV_BUDGET = 2 * 1024**3  # bytes of KV cache on CPU unless kv_cache_memory_gb says otherwise


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


@dataclass(frozen=True, slots=True)
class Loaded:
    """A model loaded on its device, with what was settled on the way."""

    source: Source
    config: ModelConfig  # the whole model's (a tensor-parallel rank's model has its part: model.config)
    model: LlamaForCausalLM
    device: torch.device
    kernels: TorchKernels
    dtype: torch.dtype  # the weights'
    matmul: torch.dtype  # what the products multiply in
    max_len: int
    kv_dtype: torch.dtype  # the KV cache's (`kv_cache_dtype`)

    @property
    def activations(self) -> torch.dtype:
        return self.kernels.activation_dtype(self.device, self.dtype)


def load(args: EngineArgs, path: Path, device: torch.device, tp: TensorParallel | None = None) -> Loaded:
    """Steps 2-4: the configuration, then the model on its device (with `tp`, this rank's part)."""
    source = open_source(path)  # the directory, or the GGUF file opened once
    model_config = load_config(source)
    if not isinstance(source, GgufCheckpoint):
        model_config = with_generation_eos(model_config, path)
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
    kv_dtype = kv_cache_dtype(args.kv_cache_dtype, kernels.activation_dtype(device, dtype), device)
    if kv_dtype == Q8_0 and model_config.head_dim % Q8_ELEMENTS:
        raise ConfigError(
            f"kv_cache_dtype='q8_0' keeps each head in blocks of {Q8_ELEMENTS}, and this model's heads have "
            f"{model_config.head_dim} elements: use float16 or bfloat16"
        )
    budget = _kv_budget_tokens(args, model_config, kv_dtype, device)
    max_len = _max_model_len(args.max_model_len, model_config, budget)
    progress = args.show_progress and (tp is None or tp.rank == 0)
    file_experts = _experts_in_file(args, path, source, model_config, device, matmul)
    if device.type == "cpu" and tp is None:
        in_file = (
            source.expert_bytes(FILE_KINDS) if file_experts and isinstance(source, GgufCheckpoint) else 0
        )
        check_fits(path, in_file)  # before reading a tensor (weft/engine/fit.py)
    start = time.perf_counter()
    model = load_model(
        source, model_config, dtype, device, max_len, progress, matmul, quantization, kernels=kernels, tp=tp,
        file_experts=file_experts,
    )  # fmt: skip
    if progress:
        report_load(path, time.perf_counter() - start, in_file)
    return Loaded(source, model_config, model, device, kernels, dtype, matmul, max_len, kv_dtype)


def _experts_in_file(
    args: EngineArgs,
    path: Path,
    source: Source,
    config: ModelConfig,
    device: torch.device,
    matmul: torch.dtype,
) -> bool:
    """`expert_weights` for this load (weft/engine/fit.py): it applies to a GGUF file with experts on
    CPU with int8 products, and asking for "file" elsewhere is an error that says where it runs."""
    applies = isinstance(source, GgufCheckpoint) and config.num_experts > 0 and device.type == "cpu"
    applies = applies and matmul == torch.int8
    if args.expert_weights == "file" and not applies and config.num_experts > 0:
        raise ConfigError(
            "expert_weights='file' multiplies a GGUF file's quantized experts in its own blocks, on CPU with "
            "int8 products (matmul_precision auto or int8); use expert_weights=auto or panels here"
        )
    return experts_in_file(args.expert_weights, path, applies)


def with_generation_eos(config: ModelConfig, model_dir: Path) -> ModelConfig:
    """generation_config.json may name more end-of-sequence tokens than config.json."""
    gen = read_optional_json(model_dir / "generation_config.json")
    eos = gen.get("eos_token_id")
    extra = tuple(eos) if isinstance(eos, list) else ((eos,) if isinstance(eos, int) else ())
    merged = tuple(dict.fromkeys(config.eos_token_ids + extra))
    return replace(config, eos_token_ids=merged)


def _max_model_len(requested: int | None, config: ModelConfig, budget_tokens: int | None) -> int:
    """The context: as asked; else the model's own, as far as one sequence's KV cache fits the KV
    budget (`budget_tokens`; None where it is known only once the model is loaded: CUDA) but at
    least `DEFAULT_MAX_MODEL_LEN`; within the model's positions."""
    if requested is not None and requested > config.max_position_embeddings:
        raise ConfigError(
            f"max_model_len={requested} exceeds the model's max_position_embeddings "
            f"({config.max_position_embeddings})"
        )
    default = max(DEFAULT_MAX_MODEL_LEN, budget_tokens or 0)
    return min(requested or default, config.max_position_embeddings)


def _kv_budget_tokens(
    args: EngineArgs, config: ModelConfig, kv_dtype: torch.dtype, device: torch.device
) -> int | None:
    """The tokens the KV budget holds for one sequence (`num_kv_blocks`, `kv_cache_memory_gb`, or on
    CPU 2 GiB; sliding-window layers in their own pool hold only a window); None on CUDA without
    either (half the memory left once the model is loaded)."""
    if args.num_kv_blocks is not None:
        return args.num_kv_blocks * args.block_size
    window_pool = has_window_pool(config, config.max_position_embeddings, args.window_kv_pool)
    layer_token = ModelRunner.kv_bytes_per_block(config, 1, kv_dtype) // config.num_layers
    per_token = bytes_per_token(config, layer_token, window_pool)
    if per_token == 0:  # every layer slides within its own pool: a sequence's length costs nothing more
        return config.max_position_embeddings
    if args.kv_cache_memory_gb is not None:
        return int(args.kv_cache_memory_gb * 1024**3) // per_token
    return CPU_KV_BUDGET // per_token if device.type == "cpu" else None
