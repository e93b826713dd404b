"""Hugging Face `architectures` name -> weft model class and its switches."""

from __future__ import annotations

from dataclasses import dataclass

from weft.config import ConfigError, ModelConfig
from weft.model.llama import DecoderSpec, LlamaForCausalLM


@dataclass(frozen=True, slots=True)
class Architecture:
    model_class: type[LlamaForCausalLM]
    spec: DecoderSpec


_LLAMA = Architecture(LlamaForCausalLM, DecoderSpec())
_LLAMA_BIAS = Architecture(LlamaForCausalLM, DecoderSpec(qkv_bias=True, o_bias=True))

ARCHITECTURES: dict[str, Architecture] = {
    "LlamaForCausalLM": _LLAMA,
    "MistralForCausalLM": _LLAMA,
    "Qwen2ForCausalLM": Architecture(LlamaForCausalLM, DecoderSpec(qkv_bias=True)),
    "Qwen3ForCausalLM": Architecture(LlamaForCausalLM, DecoderSpec(qk_norm=True)),
    "GraniteForCausalLM": _LLAMA,  # its scales are values of the configuration
    "SmolLM3ForCausalLM": _LLAMA,  # its layers without rotary embedding too
    "Phi3ForCausalLM": _LLAMA,  # fused q|k|v and gate|up as weft fuses them; partial rotary, LongRoPE
    "Gemma2ForCausalLM": Architecture(
        LlamaForCausalLM, DecoderSpec(sandwich_norms=True, norms_plus_one=True)
    ),
    "Gemma3ForCausalLM": Architecture(
        LlamaForCausalLM, DecoderSpec(qk_norm=True, sandwich_norms=True, norms_plus_one=True)
    ),
    "Qwen3MoeForCausalLM": Architecture(LlamaForCausalLM, DecoderSpec(qk_norm=True)),
    "Qwen2MoeForCausalLM": Architecture(LlamaForCausalLM, DecoderSpec(qkv_bias=True)),
    "MixtralForCausalLM": _LLAMA,  # its experts are values of the configuration
    "OlmoeForCausalLM": Architecture(LlamaForCausalLM, DecoderSpec(qk_norm=True, qk_norm_all_heads=True)),
    "GptOssForCausalLM": Architecture(LlamaForCausalLM, DecoderSpec(qkv_bias=True, o_bias=True)),
    "Olmo2ForCausalLM": Architecture(
        LlamaForCausalLM, DecoderSpec(qk_norm=True, qk_norm_all_heads=True, post_norms=True)
    ),
}


def resolve_architecture(config: ModelConfig) -> Architecture:
    arch = ARCHITECTURES.get(config.architecture)
    if arch is None:
        supported = ", ".join(sorted(ARCHITECTURES))
        raise ConfigError(f"architecture {config.architecture!r} is not supported; supported: {supported}")
    if arch is _LLAMA and config.attention_bias:
        arch = _LLAMA_BIAS
    elif config.attention_bias and not arch.spec.qkv_bias:
        arch = Architecture(
            arch.model_class, DecoderSpec(qkv_bias=True, o_bias=True, qk_norm=arch.spec.qk_norm)
        )
    _check_partial_rotary(config, arch.spec)
    return arch


def _check_partial_rotary(config: ModelConfig, spec: DecoderSpec) -> None:
    """A partial rotary embedding runs as a whole-head rotation after the loader reorders q's and k's
    head dimensions (`partial_rotary_order`); q/k biases and q/k norms would need that order too."""
    if config.rope.partial_rotary_factor >= 1.0 or not (spec.qkv_bias or spec.qk_norm):
        return
    what = "q/k/v biases" if spec.qkv_bias else "q/k norms"
    raise ConfigError(
        f"{config.architecture}: a partial rotary embedding (partial_rotary_factor="
        f"{config.rope.partial_rotary_factor}) together with {what} is not supported; weft runs "
        "partial rotary embeddings without them (Phi-3, Phi-4-mini)"
    )
