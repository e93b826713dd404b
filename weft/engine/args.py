"""The engine's options, said once: `EngineArgs` is the keyword arguments of `LLM` and, field by
field, the command-line options of `weft serve`, `weft generate` and `weft score`.

Each field's metadata, `cli(...)`, carries its help text (and its command-line type and choices);
`add_engine_arguments` turns the fields into argparse options (`max_num_seqs` -> `--max-num-seqs`,
a boolean -> `--enforce-eager` / `--no-enforce-eager`) and `engine_options` reads them back.
"""

from __future__ import annotations

import argparse
from collections.abc import Iterable, Sequence
from dataclasses import Field, dataclass, field, fields
from pathlib import Path
from typing import Any

import torch

from weft.config import (
    EXPERT_WEIGHTS,
    EXPERT_WEIGHTS_HELP,
    KV_CACHE_DTYPE_HELP,
    KV_CACHE_DTYPES,
    MATMUL_PRECISION_HELP,
    MATMUL_PRECISIONS,
)
from weft.model.quantize import QUANTIZATIONS


def cli(
    help: str, *, type: Any = None, choices: Sequence[str] | None = None, aliases: Sequence[str] = ()
) -> dict[str, Any]:
    """An `EngineArgs` field's command-line option, as the field's metadata: its help text, the type
    its value parses as (default: the type of the field's default), its choices and other flags."""
    return {"help": help, "type": type, "choices": choices, "aliases": tuple(aliases)}


@dataclass(frozen=True, slots=True)
class EngineArgs:
    """The user-facing options of an engine (the keyword arguments of `LLM`)."""

    model: str | Path | None = field(
        default=None,
        metadata=cli(
            "checkpoint directory, GGUF file or model id (default: the default model, SmolLM2-135M-Instruct "
            "where it is installed, else the bundled model)",
            type=str,
        ),
    )
    tokenizer: str | Path | None = field(
        default=None, metadata=cli("a Hugging Face tokenizer directory (default: the model's)", type=str)
    )
    dtype: str | torch.dtype | None = field(
        default=None,
        metadata=cli(
            "the weights' dtype: float32, bfloat16, float16 or auto (default auto: the checkpoint's half "
            "precision where the device runs it fast, else float32)",
            type=str,
        ),
    )
    device: str | torch.device | None = field(
        default=None, metadata=cli("cpu or cuda (default: cuda when available)", type=str)
    )
    max_model_len: int | None = field(
        default=None,
        metadata=cli(
            "context length (default: the model's, as far as one sequence's KV cache fits the KV memory, "
            "and at least 8192)",
            type=int,
        ),
    )
    block_size: int = field(default=16, metadata=cli("tokens per KV-cache block (default: 16)"))
    max_num_seqs: int = field(default=64, metadata=cli("sequences per step (default: 64)"))
    max_num_batched_tokens: int | None = field(
        default=None, metadata=cli("tokens per step (default: 2048, at least the block size)", type=int)
    )
    num_kv_blocks: int | None = field(
        default=None, metadata=cli("KV-cache blocks (default: from --kv-cache-memory-gb)", type=int)
    )
    kv_cache_memory_gb: float | None = field(
        default=None,
        metadata=cli("KV-cache memory (default: 2 GiB on CPU, half the free memory on CUDA)", type=float),
    )
    kv_cache_dtype: str = field(
        default="auto", metadata=cli(KV_CACHE_DTYPE_HELP, type=str, choices=KV_CACHE_DTYPES)
    )
    enable_prefix_caching: bool = field(
        default=True, metadata=cli("reuse the KV blocks of shared prompt prefixes (default: on)")
    )
    window_kv_pool: bool = field(
        default=True,
        metadata=cli(
            "keep sliding-window layers' KV in a pool of their own, where a sequence holds only its "
            "window (Gemma, gpt-oss, Mistral with a window; default: on)"
        ),
    )
    max_logprobs: int = field(default=20, metadata=cli("most top logprobs a request may ask (default: 20)"))
    seed: int = field(
        default=0, metadata=cli("engine seed: sampling of requests without a seed of their own (default: 0)")
    )
    show_progress: bool = True  # progress bars and the kernel line while loading (not a command-line option)
    enforce_eager: bool = field(
        default=False, metadata=cli("no CUDA graphs: every step runs eagerly (CUDA only)")
    )
    async_scheduling: bool | None = field(
        default=None,
        metadata=cli(
            "schedule the next step before this one's tokens are read back (default: on for CUDA)", type=bool
        ),
    )
    # what the linear layers' products multiply in on CPU (`TorchKernels.matmul_dtype`)
    matmul_precision: str | None = field(
        default=None, metadata=cli(MATMUL_PRECISION_HELP, type=str, choices=MATMUL_PRECISIONS)
    )
    # where a GGUF file's mixture of experts keeps its experts on CPU (weft/engine/fit.py)
    expert_weights: str = field(
        default="auto",
        metadata=cli(EXPERT_WEIGHTS_HELP, type=str, choices=EXPERT_WEIGHTS),
    )
    # quantize a float checkpoint's matrices as it loads (CPU; weft/model/quantize.py)
    quantization: str | None = field(
        default=None,
        metadata=cli(
            "CPU: quantize a float checkpoint's matrices as it loads (q8_0: llama.cpp's Q8_0 blocks, "
            "q4_k: its Q4_K blocks)",
            type=str,
            choices=QUANTIZATIONS,
        ),
    )

    tensor_parallel_size: int = field(
        default=1,
        metadata=cli(
            "processes the model is sharded over, one per GPU on CUDA, sharing the cores on CPU (default: 1)",
            aliases=("-tp",),
        ),
    )
    speculative_config: dict[str, Any] | str | None = field(
        default=None,
        metadata=cli(
            'speculative decoding without a draft model, as JSON: {"method": "ngram", '
            '"num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 4} '
            "(default: off)",
            type=str,
        ),
    )

    @classmethod
    def of(cls, model: str | Path | None, options: dict[str, Any]) -> EngineArgs:
        """`EngineArgs(model=model, **options)`, with an error that lists the options when one is
        not among them."""
        unknown = sorted(set(options) - {f.name for f in fields(cls)})
        if unknown:
            known = ", ".join(f.name for f in fields(cls))
            raise TypeError(f"unknown engine option(s) {unknown}; the options are: {known}")
        return cls(model=model, **options)


def cli_fields(exclude: Iterable[str] = ()) -> list[Field[Any]]:
    """The `EngineArgs` fields that are command-line options, less `exclude`."""
    skip = set(exclude)
    return [f for f in fields(EngineArgs) if "help" in f.metadata and f.name not in skip]


def add_engine_arguments(
    parser: argparse.ArgumentParser | argparse._ArgumentGroup, exclude: Iterable[str] = ()
) -> None:
    """One command-line option per `EngineArgs` field (less `exclude`), named as the field is."""
    for f in cli_fields(exclude):
        flag = "--" + f.name.replace("_", "-")
        meta, default = f.metadata, f.default
        parse = meta["type"] or type(default)
        if parse is bool:  # --enforce-eager / --no-enforce-eager
            action = argparse.BooleanOptionalAction
            parser.add_argument(flag, action=action, default=default, help=meta["help"])
            continue
        flags = [*meta["aliases"], flag]
        parser.add_argument(*flags, type=parse, default=default, choices=meta["choices"], help=meta["help"])


def engine_options(namespace: argparse.Namespace, exclude: Iterable[str] = ()) -> dict[str, Any]:
    """The values of the options `add_engine_arguments(..., exclude)` added, by field name: the
    keyword arguments of `EngineArgs` or `LLM`."""
    return {f.name: getattr(namespace, f.name) for f in cli_fields(exclude)}
