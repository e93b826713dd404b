"""Frozen configuration objects. This is the one module that reads configuration files and
environment variables.

Each component receives only its own sub-config: the scheduler a `SchedulerConfig`, the KV cache a
`CacheConfig`, the model a `ModelConfig`.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path
from typing import Any

import torch

from weft.kv_format import Q8_0


class ConfigError(ValueError):
    """A configuration file or option that weft cannot use; the message names the file or option."""


class RopeType(StrEnum):
    DEFAULT = "default"
    LINEAR = "linear"
    LLAMA3 = "llama3"
    YARN = "yarn"
    LONGROPE = "longrope"


@dataclass(frozen=True, slots=True)
class RopeConfig:
    theta: float
    rope_type: RopeType = RopeType.DEFAULT
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192
    # llama.cpp's rope_freqs (GGUF files of Llama 3.1 and later): each frequency divided by its factor
    freq_factors: tuple[float, ...] = ()
    # YaRN (weft/model/layers.py `_yarn_scaled`): the band of rotations between which frequencies
    # move from kept to interpolated; YaRN's and LongRoPE's factor that cos and sin are scaled by
    # (None: 1, the other kinds)
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    attention_factor: float | None = None
    truncate: bool = True
    # LongRoPE (Phi-3, Phi-4-mini): each frequency divided by its short factor, or by its long one
    # where the context is longer than `original_max_position_embeddings` (weft/model/layers.py)
    short_factor: tuple[float, ...] = ()
    long_factor: tuple[float, ...] = ()
    # the share of each head's dimensions that rotate (Phi-4-mini: 0.75); the rest pass through
    partial_rotary_factor: float = 1.0


@dataclass(frozen=True, slots=True)
class ModelConfig:
    """The shape of a decoder-only transformer, read from a Hugging Face config.json."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope: RopeConfig
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    checkpoint_dtype: torch.dtype | None = None  # the dtype config.json says the weights are stored in
    # Granite's scales (1.0 / None elsewhere): the embedding times `embedding_multiplier`, each
    # layer's attention and MLP output times `residual_multiplier` before the residual add, the
    # attention scores times `attention_multiplier` (None: head_dim ** -0.5), logits divided by
    # `logits_scaling`
    embedding_multiplier: float = 1.0
    residual_multiplier: float = 1.0
    attention_multiplier: float | None = None
    logits_scaling: float = 1.0
    # SmolLM3: whether each layer rotates q and k (empty: every layer does)
    rope_layers: tuple[bool, ...] = ()
    # The attention window of sliding-window layers: a query sees itself and the `sliding_window - 1`
    # keys before it (Mistral, Phi-3: every layer; Gemma, gpt-oss: the layers `sliding_layers` names);
    # None: every layer attends to every earlier position
    sliding_window: int | None = None
    sliding_layers: tuple[bool, ...] = ()  # whether each layer slides (empty: all, given a window)
    # Gemma's: the rotary embedding of sliding-window layers (its own base); None: `rope` in every layer
    sliding_rope: RopeConfig | None = None
    # the MLP's gate activation: "silu" (SwiGLU) or "gelu_pytorch_tanh" (Gemma's GeGLU)
    hidden_act: str = "silu"
    final_logit_softcapping: float | None = None  # logits -> c * tanh(logits / c) (Gemma 2's c = 30)
    attn_logit_softcapping: float | None = None  # attention scores likewise (Gemma 2's c = 50)
    # A mixture of experts in place of the MLP (weft/model/moe.py): `num_experts` of
    # `moe_intermediate_size` columns each, `experts_per_token` of them per row, their weights divided
    # by their sum where `norm_topk_prob`; in the layers `moe_layers` names (empty: all); 0: no experts
    num_experts: int = 0
    experts_per_token: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False
    # Qwen2-MoE's shared expert beside the routed ones, of this many columns, its output scaled by
    # sigmoid(a learned [1, hidden] gate . x); 0: none
    shared_expert_intermediate_size: int = 0
    moe_layers: tuple[bool, ...] = ()
    # gpt-oss's: biases on the router and the experts' matrices, the experts' clamped SwiGLU
    # (`swiglu_limit`; None: plain SwiGLU), a learned sink logit per head in every attention softmax
    expert_bias: bool = False
    swiglu_limit: float | None = None
    swiglu_alpha: float = 1.702
    attention_sinks: bool = False

    @property
    def fits_decoder_stack(self) -> bool:
        """Layers the fused decode stack runs: Llama's, with Granite's scales (the embedding's and
        the logits' are applied outside the stack, the attention's is its scale, the residual one the
        stack's `residual_scale`), SmolLM3's layers without rotary embedding, and Gemma's (norms
        around each branch, GeGLU, soft-capped scores, sliding-window layers with a rotation of
        their own), attention sinks, and mixtures of experts (gpt-oss's with biases and its clamped
        SwiGLU)."""
        return self.hidden_act in ("silu", "gelu_pytorch_tanh")

    def layer_has_experts(self, layer: int) -> bool:
        """Whether layer `layer` runs a mixture of experts instead of an MLP."""
        return self.num_experts > 0 and (not self.moe_layers or self.moe_layers[layer])

    def layer_window(self, layer: int) -> int:
        """The keys a query of layer `layer` sees, itself included; 0: every earlier one."""
        if self.sliding_window is None or (self.sliding_layers and not self.sliding_layers[layer]):
            return 0
        return self.sliding_window

    @classmethod
    def from_dict(cls, raw: dict[str, Any], source: str = "config.json") -> ModelConfig:
        try:
            return _model_config_from_dict(raw)
        except KeyError as exc:
            raise ConfigError(f"{source}: missing required field {exc.args[0]!r}") from None
        except (TypeError, ValueError) as exc:
            raise ConfigError(f"{source}: {exc}") from None

    @classmethod
    def from_file(cls, path: Path) -> ModelConfig:
        return cls.from_dict(read_json(path), source=str(path))


def _model_config_from_dict(raw: dict[str, Any]) -> ModelConfig:
    architectures = raw.get("architectures") or []
    if not architectures:
        raise ValueError("no 'architectures' entry, so the model class is unknown")
    num_heads = int(raw["num_attention_heads"])
    hidden_size = int(raw["hidden_size"])
    if raw.get("mlp_bias"):
        raise ValueError("mlp_bias=true is not supported")
    fields: dict[str, Any] = dict(
        architecture=str(architectures[0]),
        vocab_size=int(raw["vocab_size"]),
        hidden_size=hidden_size,
        intermediate_size=int(raw["intermediate_size"]),
        num_layers=int(raw["num_hidden_layers"]),
        num_heads=num_heads,
        num_kv_heads=int(raw.get("num_key_value_heads") or num_heads),
        head_dim=int(raw.get("head_dim") or hidden_size // num_heads),
        rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
        rope=_rope_config(raw),
        max_position_embeddings=int(raw.get("max_position_embeddings", 2048)),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        attention_bias=bool(raw.get("attention_bias", False)),
        bos_token_id=raw.get("bos_token_id"),
        eos_token_ids=_as_id_tuple(raw.get("eos_token_id")),
        checkpoint_dtype=DTYPES.get(str(raw.get("dtype") or raw.get("torch_dtype"))),
        embedding_multiplier=float(raw.get("embedding_multiplier", 1.0)),
        residual_multiplier=float(raw.get("residual_multiplier", 1.0)),
        attention_multiplier=None
        if raw.get("attention_multiplier") is None
        else float(raw["attention_multiplier"]),
        logits_scaling=float(raw.get("logits_scaling", 1.0)),
        rope_layers=_rope_layers(raw),
        sliding_window=_sliding_window(raw),
        sliding_layers=_sliding_layers(raw),
        sliding_rope=_sliding_rope(raw),
        hidden_act=_hidden_act(raw),
    )
    fields.update(_gemma_scales(raw, hidden_size))
    fields.update(_experts(raw))
    return ModelConfig(**fields)


def _experts(raw: dict[str, Any]) -> dict[str, Any]:
    """The mixture of experts: Qwen2/3-MoE's and OLMoE's `num_experts` (experts of
    `moe_intermediate_size`, else `intermediate_size`), Mixtral's `num_local_experts` (weights always
    normalised); Qwen2/3-MoE's dense layers (`mlp_only_layers`, `decoder_sparse_step`), Qwen2-MoE's
    shared expert."""
    count = int(raw.get("num_experts") or raw.get("num_local_experts") or 0)
    if count == 0:
        return {}
    layers, dense = int(raw["num_hidden_layers"]), set(raw.get("mlp_only_layers") or [])
    step = int(raw.get("decoder_sparse_step") or 1)
    moe_layers = tuple(i not in dense and (i + 1) % step == 0 for i in range(layers))
    experts: dict[str, Any] = {
        "num_experts": count,
        "experts_per_token": int(raw["num_experts_per_tok"]),
        "moe_intermediate_size": int(raw.get("moe_intermediate_size") or raw["intermediate_size"]),
        "norm_topk_prob": bool(raw.get("norm_topk_prob", "num_local_experts" in raw)),
        "moe_layers": () if all(moe_layers) else moe_layers,
        "shared_expert_intermediate_size": int(raw.get("shared_expert_intermediate_size") or 0),
    }
    if "GptOssForCausalLM" in (raw.get("architectures") or []):  # softmax over its top-k logits
        experts.update(
            norm_topk_prob=True,
            expert_bias=True,
            swiglu_limit=float(raw.get("swiglu_limit", 7.0)),
            swiglu_alpha=float(raw.get("swiglu_alpha", 1.702)),
            attention_sinks=True,
        )
    return experts


GELU_TANH = ("gelu_pytorch_tanh", "gelu_tanh")  # the names configs give GELU's tanh approximation


def _hidden_act(raw: dict[str, Any]) -> str:
    """The MLP's gate activation (Gemma names it `hidden_activation`)."""
    act = str(raw.get("hidden_activation") or raw.get("hidden_act") or "silu")
    if act in GELU_TANH:
        return "gelu_pytorch_tanh"
    if act != "silu":
        raise ValueError(f"hidden activation {act!r} is not supported (silu, gelu_pytorch_tanh)")
    return act


def _is_gemma(raw: dict[str, Any]) -> bool:
    return any(a.startswith("Gemma") for a in raw.get("architectures") or [])


def _gemma_scales(raw: dict[str, Any], hidden_size: int) -> dict[str, Any]:
    """Gemma's embedding times sqrt(hidden) and attention scores times
    `query_pre_attn_scalar ** -0.5` (as `ModelConfig`'s Granite scales); nothing for the others."""
    if not _is_gemma(raw):
        return {}
    scales: dict[str, Any] = {"embedding_multiplier": hidden_size**0.5}
    if raw.get("attn_logit_softcapping") is not None:
        scales["attn_logit_softcapping"] = float(raw["attn_logit_softcapping"])
    if raw.get("final_logit_softcapping") is not None:
        scales["final_logit_softcapping"] = float(raw["final_logit_softcapping"])
    if raw.get("query_pre_attn_scalar") is not None:
        scales["attention_multiplier"] = float(raw["query_pre_attn_scalar"]) ** -0.5
    return scales


def _sliding_window(raw: dict[str, Any]) -> int | None:
    """The attention window the model uses: `sliding_window`, unless `use_sliding_window` is false
    (Qwen2's configs name a window they do not use)."""
    window = raw.get("sliding_window")
    if window is None or raw.get("use_sliding_window") is False:
        return None
    return int(window)


def _sliding_layers(raw: dict[str, Any]) -> tuple[bool, ...]:
    """Which layers slide: `layer_types` (transformers' newer configs), Gemma 3's
    `sliding_window_pattern` (every n-th layer global), Gemma 2's alternation (even layers slide),
    Qwen2's `max_window_layers` (the layers from it on slide); () where every layer does."""
    num_layers = int(raw["num_hidden_layers"])
    if raw.get("layer_types"):
        return tuple(kind == "sliding_attention" for kind in raw["layer_types"])
    architectures = raw.get("architectures") or []
    if "Gemma3ForCausalLM" in architectures or raw.get("model_type") == "gemma3_text":
        pattern = int(raw.get("sliding_window_pattern", 6))
        return tuple((i + 1) % pattern != 0 for i in range(num_layers))
    if "Gemma2ForCausalLM" in architectures:
        return tuple(i % 2 == 0 for i in range(num_layers))
    if raw.get("max_window_layers") is not None and "Qwen2ForCausalLM" in architectures:
        return tuple(i >= int(raw["max_window_layers"]) for i in range(num_layers))
    return ()


def _rope_layers(raw: dict[str, Any]) -> tuple[bool, ...]:
    """SmolLM3's `no_rope_layers` (despite its name, 1 where a layer uses rotary embedding), or
    every `no_rope_layer_interval`-th layer without; () for families that rotate in every layer."""
    if raw.get("no_rope_layers") is not None:
        return tuple(bool(v) for v in raw["no_rope_layers"])
    interval = raw.get("no_rope_layer_interval")
    if interval is None or "SmolLM3ForCausalLM" not in (raw.get("architectures") or []):
        return ()
    return tuple((i + 1) % int(interval) != 0 for i in range(int(raw["num_hidden_layers"])))


def _sliding_rope(raw: dict[str, Any]) -> RopeConfig | None:
    """Gemma's rotary embedding of its sliding-window layers: `rope_parameters["sliding_attention"]`
    (transformers 5) or the base `rope_local_base_freq` (transformers 4, default 10,000)."""
    if not _is_gemma(raw):
        return None
    params = raw.get("rope_parameters") or {}
    if "sliding_attention" in params:
        return _rope_config({**raw, "rope_parameters": params["sliding_attention"], "rope_scaling": None})
    return RopeConfig(theta=float(raw.get("rope_local_base_freq", 10000.0)))


def _rope_config(raw: dict[str, Any]) -> RopeConfig:
    """Rope settings from either layout: `rope_theta` + `rope_scaling` (transformers 4) or
    `rope_parameters` (transformers 5; Gemma's per layer kind, of which the global layers' here)."""
    params = dict(raw.get("rope_parameters") or {})
    if "full_attention" in params:
        params = dict(params["full_attention"] or {})
    scaling = dict(raw.get("rope_scaling") or {})
    merged = {**scaling, **params}
    theta = float(merged.get("rope_theta", raw.get("rope_theta", 10000.0)))
    kind = str(merged.get("rope_type", merged.get("type", "default")))
    kind = "longrope" if kind == "su" else kind  # Phi-3's first name for it
    try:
        rope_type = RopeType(kind)
    except ValueError:
        supported = ", ".join(t.value for t in RopeType)
        raise ValueError(f"rope scaling type {kind!r} is not supported (supported: {supported})") from None
    original = merged.get("original_max_position_embeddings") or raw.get("original_max_position_embeddings")
    partial = float(merged.get("partial_rotary_factor") or raw.get("partial_rotary_factor") or 1.0)
    if rope_type == RopeType.LONGROPE:
        return _longrope_config(raw, merged, theta, int(original or raw["max_position_embeddings"]), partial)
    return RopeConfig(
        theta=theta,
        rope_type=rope_type,
        partial_rotary_factor=partial,
        factor=float(merged.get("factor", 1.0)),
        low_freq_factor=float(merged.get("low_freq_factor", 1.0)),
        high_freq_factor=float(merged.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=int(
            merged.get("original_max_position_embeddings")
            or (raw.get("max_position_embeddings", 8192) if rope_type == RopeType.YARN else 8192)
        ),
        beta_fast=float(merged.get("beta_fast") or 32.0),
        beta_slow=float(merged.get("beta_slow") or 1.0),
        attention_factor=_yarn_attention_factor(merged) if rope_type == RopeType.YARN else None,
        truncate=bool(merged.get("truncate", True)),
    )


def _longrope_config(
    raw: dict[str, Any], params: dict[str, Any], theta: float, original: int, partial: float
) -> RopeConfig:
    """LongRoPE as transformers reads it: the factor, where not given, is the context over the
    original one; the attention factor, where not given, sqrt(1 + ln(factor) / ln(original))."""
    factor = float(params.get("factor") or raw["max_position_embeddings"] / original)
    attention = params.get("attention_factor")
    if attention is None:
        attention = 1.0 if factor <= 1 else math.sqrt(1 + math.log(factor) / math.log(original))
    return RopeConfig(
        theta=theta,
        rope_type=RopeType.LONGROPE,
        factor=factor,
        original_max_position_embeddings=original,
        attention_factor=float(attention),
        short_factor=tuple(float(f) for f in params["short_factor"]),
        long_factor=tuple(float(f) for f in params["long_factor"]),
        partial_rotary_factor=partial,
    )


def _yarn_attention_factor(params: dict[str, Any]) -> float:
    """YaRN's scale of cos and sin (as transformers reads it): `attention_factor`, or DeepSeek's
    `mscale` / `mscale_all_dim`, else 0.1 ln(factor) + 1."""
    if params.get("attention_factor") is not None:
        return float(params["attention_factor"])
    factor = float(params.get("factor", 1.0))
    mscale, all_dim = params.get("mscale"), params.get("mscale_all_dim")
    if mscale and all_dim:
        return _yarn_mscale(factor, float(mscale)) / _yarn_mscale(factor, float(all_dim))
    return _yarn_mscale(factor)


def _yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def _as_id_tuple(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, list):
        return tuple(int(v) for v in value)
    return (int(value),)


def _require(ok: bool, name: str, value: object, rule: str) -> None:
    if not ok:
        raise ConfigError(f"{name} {rule}, got {value!r}")


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass(frozen=True, slots=True)
class CacheConfig:
    """The paged KV cache: `num_blocks` blocks of `block_size` token slots in every layer."""

    block_size: int = 16
    num_blocks: int = 1024
    enable_prefix_caching: bool = True
    dtype: torch.dtype | None = None  # the keys' and values' dtype (None: the activations'; `kv_cache_dtype`)
    # The sliding-window layers' own pool (`weft/engine/window_blocks.py`): `num_window_blocks` blocks
    # where each sequence holds only its last `window` positions; 0: those layers share the pool above
    window: int = 0
    num_window_blocks: int = 0

    def __post_init__(self) -> None:
        _require(
            _is_int(self.block_size) and self.block_size >= 1, "block_size", self.block_size, "must be >= 1"
        )
        _require(
            _is_int(self.num_blocks) and self.num_blocks >= 1,
            "num_kv_blocks",
            self.num_blocks,
            "must be >= 1",
        )


KV_CACHE_DTYPES = ("auto", "float32", "bfloat16", "float16", "q8_0")
KV_CACHE_DTYPE_HELP = (
    "the KV cache's element type: float32, bfloat16 or float16 (half the memory and half the bytes "
    "a long context's decode step reads), or q8_0 (CPU: llama.cpp's 8-bit blocks, 34 bytes for 32 "
    "elements); attention widens them to float32 as it reads; default auto: the activations' dtype "
    "(float32 on CPU)"
)
_KV_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "q8_0": Q8_0}


def kv_cache_dtype(
    value: str | torch.dtype | None, activations: torch.dtype, device: torch.device
) -> torch.dtype:
    """The KV cache's dtype for `kv_cache_dtype=value` beside these activations on `device`: auto
    keeps the activations' (docs/architecture.md, "The KV cache's precision", says why); on CPU a
    cache of another dtype is half precision or Q8_0 (`weft/kv_format.py`) beside float32
    activations; on CUDA any of the three float dtypes."""
    if value is None or value == "auto":
        return activations
    dtype = _KV_DTYPES.get(value) if isinstance(value, str) else value
    if dtype not in _KV_DTYPES.values():
        choices = ", ".join(KV_CACHE_DTYPES)
        raise ConfigError(f"kv_cache_dtype must be one of {choices}, got {value!r}")
    assert dtype is not None
    if dtype == Q8_0 and device.type != "cpu":
        raise ConfigError(
            f"kv_cache_dtype='q8_0' is a CPU cache; on {device.type} use float16 or bfloat16 (half the "
            "memory of float32)"
        )
    if device.type == "cpu" and dtype != activations and activations != torch.float32:
        raise ConfigError(
            f"kv_cache_dtype={value!r} beside {str(activations).removeprefix('torch.')} activations: on CPU "
            "a cache of another dtype needs float32 activations (use kv_cache_dtype=auto, or dtype=float32)"
        )
    return dtype


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    max_model_len: int = 2048

    def __post_init__(self) -> None:
        for name in ("max_num_seqs", "max_num_batched_tokens"):
            value = getattr(self, name)
            _require(_is_int(value) and value >= 1, name, value, "must be >= 1")
        _require(
            _is_int(self.max_model_len) and self.max_model_len >= 2,
            "max_model_len",
            self.max_model_len,
            "must be >= 2",
        )


# ---- speculative decoding: `speculative_config` in vLLM's shape, checked: which proposer, how many
# tokens it guesses, and each proposer's own settings (weft/speculative/, weft/engine/speculation.py)

SPECULATIVE_METHODS = ("ngram", "suffix")
MAX_SPECULATIVE_TOKENS = 16
DEFAULT_LOOKUP_MIN = 2


@dataclass(frozen=True, slots=True)
class SpeculativeConfig:
    method: str = "ngram"
    num_speculative_tokens: int = 4  # k: tokens guessed per step
    prompt_lookup_min: int = DEFAULT_LOOKUP_MIN  # the shortest n-gram whose earlier occurrence is copied from
    prompt_lookup_max: int = 4  # the longest (tried first)
    # method "suffix" (weft/speculative/suffix.py), vLLM's names; a depth of 8 rather than vLLM's 24:
    # counting every context of a token costs that many dictionary updates, in Python
    suffix_decoding_max_tree_depth: int = 8
    suffix_decoding_max_cached_requests: int = 1000
    suffix_decoding_max_spec_factor: float = 1.0
    suffix_decoding_min_token_prob: float = 0.1

    def __post_init__(self) -> None:
        if self.method not in SPECULATIVE_METHODS:
            raise ValueError(
                f"speculative_config method {self.method!r}: weft has {', '.join(SPECULATIVE_METHODS)}"
            )
        if not 1 <= self.num_speculative_tokens <= MAX_SPECULATIVE_TOKENS:
            raise ValueError(
                f"speculative_config num_speculative_tokens must be in [1, {MAX_SPECULATIVE_TOKENS}], "
                f"got {self.num_speculative_tokens}"
            )
        self._check_suffix()
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
            raise ValueError(
                "speculative_config needs 1 <= prompt_lookup_min <= prompt_lookup_max, got "
                f"{self.prompt_lookup_min} and {self.prompt_lookup_max}"
            )

    def _check_suffix(self) -> None:
        checks = (
            ("suffix_decoding_max_tree_depth", 1 <= self.suffix_decoding_max_tree_depth <= 64, "in [1, 64]"),
            ("suffix_decoding_max_cached_requests", self.suffix_decoding_max_cached_requests >= 0, ">= 0"),
            ("suffix_decoding_max_spec_factor", self.suffix_decoding_max_spec_factor > 0, "> 0"),
            ("suffix_decoding_min_token_prob", 0 <= self.suffix_decoding_min_token_prob <= 1, "in [0, 1]"),
        )
        for name, ok, rule in checks:
            if not ok:
                raise ValueError(f"speculative_config {name} must be {rule}, got {getattr(self, name)}")

    @classmethod
    def of(cls, fields: Mapping[str, Any]) -> SpeculativeConfig:
        """From a dict as vLLM takes it; an unknown key is an error naming it. Only
        `prompt_lookup_max` given: `prompt_lookup_min` is the default, or the max where that is smaller."""
        unknown = set(fields) - set(cls.__dataclass_fields__)
        if unknown:
            known = ", ".join(cls.__dataclass_fields__)
            raise ValueError(
                f"speculative_config: unknown keys {', '.join(sorted(unknown))}; weft takes {known}"
            )
        values = dict(fields)
        if "prompt_lookup_max" in values and "prompt_lookup_min" not in values:
            values["prompt_lookup_min"] = min(values["prompt_lookup_max"], DEFAULT_LOOKUP_MIN)
        return cls(**values)


@dataclass(frozen=True, slots=True)
class EngineConfig:
    model: ModelConfig
    cache: CacheConfig
    scheduler: SchedulerConfig
    device: torch.device
    dtype: torch.dtype  # activations (and the KV cache where `cache.dtype` is None)
    seed: int = 0
    max_logprobs: int = 20  # the most top-n logprobs a request may ask for
    weight_dtype: torch.dtype | None = None  # None: the same as dtype
    matmul_dtype: torch.dtype | None = None  # the linear layers' products' inputs; None: the same as dtype
    # Schedule the next step before this one's tokens are read back where rows allow it
    # (weft/engine/lookahead.py): the default on CUDA, where the host's work then overlaps the device's.
    async_scheduling: bool = False
    # Speculative decoding without a draft model (weft/engine/speculation.py); None: off.
    speculative: SpeculativeConfig | None = None

    def __post_init__(self) -> None:
        _require(
            _is_int(self.max_logprobs) and self.max_logprobs >= 0,
            "max_logprobs",
            self.max_logprobs,
            "must be >= 0",
        )
        max_len, cache = self.scheduler.max_model_len, self.cache
        if cache.num_blocks * cache.block_size < max_len:
            raise ConfigError(
                f"{cache.num_blocks} KV blocks of {cache.block_size} tokens cannot hold one sequence of "
                f"max_model_len={max_len}; give more blocks or a smaller max_model_len"
            )


DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
}


def resolve_dtype(
    dtype: str | torch.dtype | None,
    device: torch.device,
    checkpoint: torch.dtype | None = None,
    fast_half_on_cpu: bool = False,
) -> torch.dtype:
    """The weights' dtype. `None`/"auto" means the checkpoint's own dtype where the device runs it
    fast: on CUDA the checkpoint's half-precision dtype (bfloat16 for a float32 checkpoint); on CPU
    the checkpoint's half-precision dtype when weft's kernels stream it (`fast_half_on_cpu`), else
    float32."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype is None or dtype == "auto":
        half = checkpoint if checkpoint in (torch.bfloat16, torch.float16) else None
        if device.type == "cuda":
            return half or torch.bfloat16
        return half if half is not None and fast_half_on_cpu else torch.float32
    if dtype not in DTYPES:
        raise ConfigError(f"dtype {dtype!r} is not supported; use one of {sorted(DTYPES)} or 'auto'")
    return DTYPES[dtype]


MATMUL_PRECISIONS = ("auto", "float32", "bfloat16", "int8")
EXPERT_WEIGHTS = ("auto", "panels", "file")
EXPERT_WEIGHTS_HELP = (
    "CPU, a GGUF file's mixture of experts: where its Q4_K and Q6_K experts are kept: panels (repacked "
    "into weft's dot panels as the file loads: the fastest products, a second copy of the experts), file "
    "(multiplied in the file's own blocks from its pages: nothing copied, loads in seconds, shares the page "
    "cache with other processes reading the file, slower products), auto (panels where the file fits the "
    "memory available with 1.5 GB to spare, else file; the default)"
)
MATMUL_PRECISION_HELP = (
    "CPU: what the matrix products multiply in: float32 (exact, the weights widened), bfloat16 (bfloat16 "
    "weights: x rounded to bfloat16, float32 accumulation, twice the arithmetic rate) or int8 (quantized "
    "GGUF weights: x rounded to int8 in blocks, as llama.cpp rounds it); default auto: int8 for "
    "quantized weights, bfloat16 for bfloat16 weights where the CPU has AVX512_BF16, else float32"
)


def check_matmul_precision(value: str | None) -> str:
    """`matmul_precision` as given (`LLM`, `--matmul-precision`): "auto" (None), "float32", "bfloat16"
    or "int8"."""
    if value is None:
        return "auto"
    if value not in MATMUL_PRECISIONS:
        choices = list(MATMUL_PRECISIONS)
        raise ConfigError(f"matmul_precision {value!r} is not supported; use one of {choices}")
    return value


def resolve_device(device: str | torch.device | None) -> torch.device:
    if device is None or device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        raise ConfigError(f"{path}: file not found")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{path}: not valid JSON ({exc})") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a JSON object at the top level")
    return data


def read_optional_json(path: Path) -> dict[str, Any]:
    return read_json(path) if path.is_file() else {}


@dataclass(frozen=True, slots=True)
class KernelChoice:
    """Which kernel set runs a model (environment variable `WEFT_KERNELS`): unset or `auto`, the
    device's best (Triton on CUDA when it imports); `triton`, the Triton set on any device (CPU
    tensors need `TRITON_INTERPRET=1`); `torch`, no Triton (CPU still takes weft's C++ kernels
    unless `WEFT_NATIVE=0`)."""

    triton: bool | None  # None: the device decides
    interpreted: bool = False  # TRITON_INTERPRET=1: Triton kernels run on CPU tensors, slowly

    @classmethod
    def from_env(cls) -> KernelChoice:
        value = os.environ.get("WEFT_KERNELS", "auto").strip().lower()
        choices = {"auto": None, "": None, "triton": True, "torch": False}
        if value not in choices:
            raise ConfigError(f"WEFT_KERNELS={value!r}: use auto, triton or torch")
        return cls(choices[value], os.environ.get("TRITON_INTERPRET", "0") == "1")


@dataclass(frozen=True, slots=True)
class NativeConfig:
    """Where weft's CPU kernels are built, and whether to use them (environment variables:
    `WEFT_NATIVE=0` turns them off; `WEFT_CACHE_DIR` moves the build cache, by default
    `$XDG_CACHE_HOME/weft` or `~/.cache/weft`; `WEFT_NATIVE_SANITIZE=1` builds them with
    AddressSanitizer and UndefinedBehaviorSanitizer, for tests run with libasan preloaded;
    `WEFT_NATIVE_ARCH` is the compiler's `-march`, by default `native`: `x86-64-v3` builds the
    AVX2 path that machines without AVX-512 take, `x86-64` the scalar one; `WEFT_NATIVE_CFLAGS`
    adds compiler flags; `WEFT_DENSE_ROWS=N` fixes the row count from which a
    long prefill takes torch's GEMM instead of measuring it, see weft/model/prefill_gemm.py)."""

    enabled: bool
    cache_dir: Path
    sanitize: bool = False
    arch: str = "native"
    extra_cflags: tuple[str, ...] = ()
    dense_rows: int | None = None  # WEFT_DENSE_ROWS: a fixed prefill-GEMM threshold, nothing measured

    @classmethod
    def from_env(cls) -> NativeConfig:
        xdg = os.environ.get("XDG_CACHE_HOME")
        default = (Path(xdg) if xdg else Path.home() / ".cache") / "weft"
        return cls(
            enabled=os.environ.get("WEFT_NATIVE", "1") != "0",
            cache_dir=Path(os.environ.get("WEFT_CACHE_DIR", default)),
            sanitize=os.environ.get("WEFT_NATIVE_SANITIZE", "0") == "1",
            arch=os.environ.get("WEFT_NATIVE_ARCH", "native"),
            extra_cflags=tuple(os.environ.get("WEFT_NATIVE_CFLAGS", "").split()),
            dense_rows=_optional_int("WEFT_DENSE_ROWS"),
        )


def _optional_int(name: str) -> int | None:
    """An environment variable holding a positive integer, or None when unset."""
    value = os.environ.get(name, "").strip()
    if not value:
        return None
    if not value.isdigit() or int(value) < 1:
        raise ConfigError(f"{name}={value!r}: expected a positive integer")
    return int(value)
