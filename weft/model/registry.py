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
        return _LLAMA_BIAS
    if config.attention_bias and not arch.spec.qkv_bias:
        return Architecture(
            arch.model_class, DecoderSpec(qkv_bias=True, o_bias=True, qk_norm=arch.spec.qk_norm)
        )
    return arch
