"""GGUF checkpoints (llama.cpp's one-file format): the configuration, the weights, the tokenizer and
the chat template of a model, read from one `.gguf` file (its header by weft/model/gguf_file.py, the
blocks' formats and dequantization from the `gguf` package).

Steps of `GgufCheckpoint(path)`:
  1. read the header (metadata and the tensor index; the tensor data stays memory-mapped) and
     check the architecture (`general.architecture`: `ARCHITECTURES`);
  2. `model_config()`: the `{arch}.*` keys as a Hugging Face config (sizes, heads, rope base and
     linear or YaRN scaling, norm epsilon, context length, tied embeddings when there is no
     `output` tensor, the tokenizer's BOS/EOS ids, Granite's scales, SmolLM3's layers without
     rotary embedding, Gemma 3's sliding layers and their rope base, Phi-3's partial rotary
     embedding and LongRoPE factors), and the per-frequency rope factors of a `rope_freqs` tensor
     (Llama 3.1 and later);
  3. `read_tensors()`: every tensor under its Hugging Face name, checked against the types weft
     reads (`SUPPORTED_TYPES`): a quantized matrix kept in its blocks where asked
     (`KEPT_IN_BLOCKS`), anything else dequantized exactly to float32 (`gguf.quants.dequantize`), with
     the rows of `attn_q` / `attn_k` of llama, granite and smollm3 files put back in the Hugging Face
     order (llama.cpp's converter interleaves each head's two rotary halves), and Gemma's norms
     back to Hugging Face's w from llama.cpp's 1 + w;
  4. `metadata`: the `tokenizer.*` keys, for `weft.gguf_tokenizer`.

Every error names the file and the problem, and says what weft reads instead.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any, cast

import numpy as np
import torch

from weft.config import ConfigError, ModelConfig
from weft.model.gguf_file import GgufFile, release_pages
from weft.model.quantized import QuantizedRows, Weight

GGUF_MAGIC = b"GGUF"
ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "granite": "GraniteForCausalLM",
    "smollm3": "SmolLM3ForCausalLM",
    "gemma2": "Gemma2ForCausalLM",
    "gemma3": "Gemma3ForCausalLM",
    "qwen3moe": "Qwen3MoeForCausalLM",
    "qwen2moe": "Qwen2MoeForCausalLM",
    "olmo2": "Olmo2ForCausalLM",
    "gpt-oss": "GptOssForCausalLM",
    "phi3": "Phi3ForCausalLM",
}
# Architectures whose converter (llama.cpp's LlamaModel and its subclasses) interleaves each head's
# two rotary halves in the rows of attn_q and attn_k.
PERMUTED_ROTARY = ("llama", "granite", "smollm3")
# Granite's scales: GGUF key -> config.json key
_GRANITE_SCALES = {
    "embedding_scale": "embedding_multiplier",
    "residual_scale": "residual_multiplier",
    "attention.scale": "attention_multiplier",
    "logit_scale": "logits_scaling",
}
# llama.cpp's SmolLM3 leaves rotary embedding out of every 4th layer (`n_no_rope_layer_step`, not in
# the file's metadata), as transformers' default `no_rope_layer_interval` does.
SMOLLM3_NO_ROPE_INTERVAL = 4
# What Q8_0, Q4_K_M, Q4_0 and float files of these architectures hold.
SUPPORTED_TYPES = (
    "F32", "F16", "BF16", "Q8_0", "Q4_0", "Q5_0", "Q4_1", "Q5_1",
    "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "IQ4_NL", "IQ4_XS", "MXFP4",
)  # fmt: skip
# The types whose matrices run from their blocks on CPU (an embedding table: all but Q4_K;
# weft/model/quantized.py).
KEPT_IN_BLOCKS = {
    "Q8_0": "q8_0",
    "Q4_K": "q4_k",
    "Q5_K": "q5_k",
    "Q6_K": "q6_k",
    "Q4_0": "q4_0",
    "Q5_0": "q5_0",
    "Q4_1": "q4_1",
    "Q5_1": "q5_1",
    "Q2_K": "q2_k",
    "Q3_K": "q3_k",
    "IQ4_NL": "iq4_nl",
    "IQ4_XS": "iq4_xs",
    "MXFP4": "mxfp4",  # gpt-oss's experts
}

_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "ffn_gate_inp": "mlp.gate",  # a mixture of experts' router
    # Qwen2-MoE's shared expert and its gate (a vector in the file, a [1, hidden] matrix here)
    "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
    "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
    "ffn_up_shexp": "mlp.shared_expert.up_proj",
    "ffn_down_shexp": "mlp.shared_expert.down_proj",
}
# A mixture of experts' matrices, all experts in one [experts, out, in] tensor: each expert's under
# Qwen3-MoE's names
_EXPERT_NAMES = {"ffn_gate_exps": "gate_proj", "ffn_up_exps": "up_proj", "ffn_down_exps": "down_proj"}
# Gemma's layer norms, which llama.cpp names by their place: before and after each branch
_SANDWICH_NAMES = {
    **_LAYER_NAMES,
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
# OLMo 2's norms after each branch (it has none before them), by their place
_OLMO2_NAMES = {
    **_LAYER_NAMES,
    "post_attention_norm": "post_attention_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
# gpt-oss's: llama.cpp names its norm before the MLP by its place after attention, its router by
# its role, and its sinks as a weight
_GPT_OSS_NAMES = {
    **_LAYER_NAMES,
    "post_attention_norm": "post_attention_layernorm",
    "ffn_gate_inp": "mlp.router",
    "attn_sinks": "self_attn.sinks",
}
# Phi-3's and Phi-4-mini's fused matrices, kept fused as Hugging Face's names have them
_PHI3_NAMES = {**_LAYER_NAMES, "attn_qkv": "self_attn.qkv_proj", "ffn_up": "mlp.gate_up_proj"}
# LongRoPE's per-frequency factors (Phi-3 and Phi-4-mini files): part of the configuration
ROPE_FACTORS = ("rope_factors_long.weight", "rope_factors_short.weight")
# llama.cpp's gpt-oss: every other layer slides (`set_swa_pattern(2)`), its SwiGLU clamped at 7
GPT_OSS_SLIDING_PATTERN = 2
# llama.cpp's converter stores Gemma's norms as (1 + w), their scale; Hugging Face's as w
NORMS_PLUS_ONE = ("gemma2", "gemma3")
# llama.cpp's Gemma 3: every 6th layer global, the others slide (`set_swa_pattern(6)`, not in the file)
GEMMA3_SLIDING_PATTERN = 6
ROPE_FREQS = "rope_freqs.weight"  # llama.cpp's per-frequency rope factors (Llama 3.1 rope scaling)
_LAYER_TENSOR = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")


class GgufError(ConfigError):
    """A GGUF file weft cannot run; the message names the file and the problem."""


def is_gguf(path: Path) -> bool:
    """Whether `path` is a file that starts with GGUF's magic bytes."""
    if not path.is_file():
        return False
    with path.open("rb") as f:
        return f.read(4) == GGUF_MAGIC


def hf_name(name: str, arch: str = "llama") -> str | None:
    """The Hugging Face name of a GGUF tensor of architecture `arch`, or None for one weft does not
    know."""
    if name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[name]
    names = {
        "gemma2": _SANDWICH_NAMES,
        "gemma3": _SANDWICH_NAMES,
        "gpt-oss": _GPT_OSS_NAMES,
        "olmo2": _OLMO2_NAMES,
        "phi3": _PHI3_NAMES,
    }.get(arch, _LAYER_NAMES)
    match = _LAYER_TENSOR.fullmatch(name)
    if match is None or match[2] not in names:
        return None
    if names[match[2]] == "self_attn.sinks":  # (a parameter of its own in transformers, not a weight)
        return f"model.layers.{match[1]}.self_attn.sinks"
    return f"model.layers.{match[1]}.{names[match[2]]}.{match[3]}"


def unpermute_rotary_rows(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """[out, ...] rows of q or k back in the Hugging Face order: llama.cpp's converter stores each
    head's rows as (half, pair) interleaved, `reshape(H, 2, D/2).swapaxes(1, 2)`; this undoes it."""
    shape = weight.shape
    return weight.reshape(num_heads, shape[0] // num_heads // 2, 2, *shape[1:]).transpose(1, 2).reshape(shape)


def _unpermuted(weight: torch.Tensor | QuantizedRows, num_heads: int) -> torch.Tensor | QuantizedRows:
    """`unpermute_rotary_rows` of a float matrix or of the rows of a quantized one (rows are whole)."""
    if isinstance(weight, QuantizedRows):
        return QuantizedRows(weight.kind, unpermute_rotary_rows(weight.rows, num_heads))
    return unpermute_rotary_rows(weight, num_heads)


class GgufCheckpoint:
    """One GGUF file, opened for reading (see the module's steps)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        try:
            self.reader = GgufFile(path)
        except Exception as exc:  # ValueError, struct errors, a GGML type gguf does not know ...
            raise GgufError(f"{path}: not a readable GGUF file ({type(exc).__name__}: {exc})") from None
        self.metadata: dict[str, Any] = {key: field.contents() for key, field in self.reader.fields.items()}
        arch = self.metadata.get("general.architecture")
        if arch not in ARCHITECTURES:
            supported = ", ".join(sorted(ARCHITECTURES))
            raise GgufError(
                f"{path}: architecture {arch!r} is not supported; weft runs GGUF files of {supported}"
            )
        self.arch: str = arch
        self._check_tensors()

    def _check_tensors(self) -> None:
        for tensor in self.reader.tensors:
            kind = tensor.tensor_type.name
            if kind not in SUPPORTED_TYPES:
                raise GgufError(
                    f"{self.path}: tensor {tensor.name!r} is stored as {kind}, which weft does not run; "
                    f"weft runs {', '.join(SUPPORTED_TYPES)} "
                    "(the types of Q8_0, Q6_K, Q5_K_M, Q4_K_M, Q3_K_M, Q2_K, IQ4_XS, IQ4_NL, Q4_0 and Q4_1 "
                    "files, and gpt-oss's MXFP4)"
                )

    @property
    def quantized(self) -> bool:
        """Whether any matrix is stored quantized (runs from quantized panels where weft packs them)."""
        return any(len(t.shape) >= 2 and t.tensor_type.name in KEPT_IN_BLOCKS for t in self.reader.tensors)

    def expert_bytes(self, kinds: Iterable[str]) -> int:
        """The bytes of the experts' matrices stored as one of `kinds` ("q4_k", ...): what stays in
        the file's pages where a load keeps experts there (`expert_weights="file"`)."""
        wanted = set(kinds)
        total = 0
        for tensor in self.reader.tensors:
            match = _LAYER_TENSOR.fullmatch(tensor.name)
            if match and match[2] in _EXPERT_NAMES and KEPT_IN_BLOCKS.get(tensor.tensor_type.name) in wanted:
                total += int(tensor.data.nbytes)
        return total

    def _key(self, name: str, default: Any = None) -> Any:
        return self.metadata.get(f"{self.arch}.{name}", default)

    def config_dict(self) -> dict[str, Any]:
        """The model's configuration in config.json's terms."""
        heads = self._key("attention.head_count")
        hidden = self._key("embedding_length")
        names = {tensor.name for tensor in self.reader.tensors}
        raw: dict[str, Any] = {
            "architectures": [ARCHITECTURES[self.arch]],
            "vocab_size": self._key("vocab_size") or len(self.metadata.get("tokenizer.ggml.tokens", [])),
            "hidden_size": hidden,
            "intermediate_size": self._key("feed_forward_length"),
            "num_hidden_layers": self._key("block_count"),
            "num_attention_heads": heads,
            "num_key_value_heads": self._key("attention.head_count_kv", heads),
            "head_dim": self._key("attention.key_length") or (hidden // heads if hidden and heads else None),
            "rms_norm_eps": self._key("attention.layer_norm_rms_epsilon", 1e-6),
            "rope_theta": self._key("rope.freq_base", 10000.0),
            "max_position_embeddings": self._key("context_length", 2048),
            "tie_word_embeddings": "output.weight" not in names,
            "attention_bias": self.arch == "llama" and "blk.0.attn_q.bias" in names,
            "bos_token_id": self.metadata.get("tokenizer.ggml.bos_token_id"),
            "eos_token_id": self.metadata.get("tokenizer.ggml.eos_token_id"),
        }
        raw.update(self._family_keys())
        return raw

    def _family_keys(self) -> dict[str, Any]:
        """config.json keys of rope scaling and of the families' own settings."""
        raw: dict[str, Any] = {}
        scaling = self._key("rope.scaling.type")
        if scaling == "linear":
            raw["rope_scaling"] = {"rope_type": "linear", "factor": self._key("rope.scaling.factor", 1.0)}
        elif scaling == "yarn":
            raw["rope_scaling"] = {
                "rope_type": "yarn",
                "factor": self._key("rope.scaling.factor", 1.0),
                "original_max_position_embeddings": self._key("rope.scaling.original_context_length"),
                "beta_fast": self._key("rope.scaling.yarn_beta_fast"),
                "beta_slow": self._key("rope.scaling.yarn_beta_slow"),
            }
        elif scaling not in (None, "none"):
            raise GgufError(f"{self.path}: rope scaling {scaling!r} is not supported (linear, yarn)")
        if self.arch == "granite":
            raw.update(
                {key: self._key(gguf_key) for gguf_key, key in _GRANITE_SCALES.items() if self._key(gguf_key)}
            )
        if self.arch == "smollm3":
            raw["no_rope_layer_interval"] = SMOLLM3_NO_ROPE_INTERVAL
        if self._key("attention.sliding_window"):
            raw["sliding_window"] = self._key("attention.sliding_window")
        if self.arch in ("gemma2", "gemma3"):
            raw.update(self._gemma_keys())
        if self._key("expert_count"):
            raw.update(self._expert_keys())
        if self.arch == "phi3":
            raw.update(self._phi3_keys())
        return raw

    def _phi3_keys(self) -> dict[str, Any]:
        """Phi-3's and Phi-4-mini's rotary embedding as llama.cpp's converter writes it: the rotating
        share of each head (`rope.dimension_count`), and LongRoPE where the file has its factors (as
        tensors), with the attention factor the converter computed."""
        heads, hidden = self._key("attention.head_count"), self._key("embedding_length")
        head_dim = self._key("attention.key_length") or hidden // heads
        rotary = self._key("rope.dimension_count", head_dim)
        keys: dict[str, Any] = {"partial_rotary_factor": rotary / head_dim}
        factors = {t.name: t for t in self.reader.tensors if t.name in ROPE_FACTORS}
        if len(factors) == len(ROPE_FACTORS):
            long, short = (self.dequantized(factors[name]).tolist() for name in ROPE_FACTORS)
            keys["rope_scaling"] = {
                "rope_type": "longrope",
                "long_factor": long,
                "short_factor": short,
                "original_max_position_embeddings": self._key("rope.scaling.original_context_length"),
                "attention_factor": self._key("rope.scaling.attn_factor"),
            }
        return keys

    def _expert_keys(self) -> dict[str, Any]:
        """A mixture of experts as llama.cpp runs Qwen3-MoE and Mixtral (a llama file with experts):
        softmax over the experts, the top `expert_used_count`, their weights normalised; Qwen2-MoE's
        not normalised, with its shared expert."""
        keys: dict[str, Any] = {
            "num_experts": self._key("expert_count"),
            "num_experts_per_tok": self._key("expert_used_count"),
            "moe_intermediate_size": self._key("expert_feed_forward_length")
            or self._key("feed_forward_length"),
            "norm_topk_prob": self.arch != "qwen2moe",
            "shared_expert_intermediate_size": self._key("expert_shared_feed_forward_length") or 0,
        }
        if self.arch == "llama":
            keys["architectures"] = ["MixtralForCausalLM"]
        if self.arch == "gpt-oss":
            layers = self._key("block_count")
            keys["layer_types"] = [
                "sliding_attention" if i % GPT_OSS_SLIDING_PATTERN == 0 else "full_attention"
                for i in range(layers)
            ]
            keys["attention_bias"] = True
        return keys

    def _gemma_keys(self) -> dict[str, Any]:
        """Gemma 2 and 3 as llama.cpp runs them: GeGLU, the scores scaled by head_dim ** -0.5 (the
        27B models' by (hidden / heads) ** -0.5, as their `query_pre_attn_scalar`), Gemma 2's soft
        caps and every other layer sliding, Gemma 3's every 6th layer global and its sliding layers'
        rope base (10,000 unless the file says)."""
        heads, layers = self._key("attention.head_count"), self._key("block_count")
        head_dim = self._key("attention.key_length") or self._key("embedding_length") // heads
        big = layers == (46 if self.arch == "gemma2" else 62)
        keys: dict[str, Any] = {
            "hidden_activation": "gelu_pytorch_tanh",
            "query_pre_attn_scalar": self._key("embedding_length") // heads if big else head_dim,
            "final_logit_softcapping": self._key("final_logit_softcapping"),
        }
        if self.arch == "gemma2":
            keys["attn_logit_softcapping"] = self._key("attn_logit_softcapping")
            keys["layer_types"] = [
                "sliding_attention" if i % 2 == 0 else "full_attention" for i in range(layers)
            ]
            return keys
        keys["rope_local_base_freq"] = self._key("rope.freq_base_swa", 10000.0)
        keys["sliding_window_pattern"] = GEMMA3_SLIDING_PATTERN
        return keys

    def model_config(self) -> ModelConfig:
        config = ModelConfig.from_dict(self.config_dict(), source=str(self.path))
        factors = next((t for t in self.reader.tensors if t.name == ROPE_FREQS), None)
        if factors is None:
            return config
        values = tuple(float(v) for v in self.dequantized(factors).flatten())
        if len(values) != config.head_dim // 2:
            raise GgufError(f"{self.path}: {ROPE_FREQS} has {len(values)} factors, not head_dim / 2")
        return replace(config, rope=replace(config.rope, freq_factors=values))

    def read_tensors(self, keep_blocks: bool = False) -> Iterator[tuple[str, Weight]]:
        """(Hugging Face name, weight) for every tensor, one at a time: float32 [out, in] or [n], or
        with `keep_blocks` a quantized matrix as its rows of blocks (`QuantizedRows`)."""
        heads = self._key("attention.head_count")
        kv_heads = self._key("attention.head_count_kv", heads)
        for tensor in self.reader.tensors:
            if tensor.name == ROPE_FREQS or tensor.name in ROPE_FACTORS:  # part of the configuration
                continue
            match = _LAYER_TENSOR.fullmatch(tensor.name)
            if match is not None and match[2] in _EXPERT_NAMES:
                matrix = f"{_EXPERT_NAMES[match[2]]}.{match[3]}"
                yield from self._experts(tensor, int(match[1]), matrix, keep_blocks and match[3] == "weight")
                continue
            name = hf_name(tensor.name, self.arch)
            if name is None:
                raise GgufError(f"{self.path}: tensor {tensor.name!r} is not one weft knows for {self.arch}")
            kind = (
                KEPT_IN_BLOCKS.get(tensor.tensor_type.name)
                if keep_blocks and len(tensor.shape) == 2
                else None
            )
            weight = self._blocks(tensor, kind) if kind else self.dequantized(tensor)
            if self.arch in PERMUTED_ROTARY and name.endswith(("q_proj.weight", "q_proj.bias")):
                weight = _unpermuted(weight, heads)
            elif self.arch in PERMUTED_ROTARY and name.endswith(("k_proj.weight", "k_proj.bias")):
                weight = _unpermuted(weight, kv_heads)
            elif self.arch in NORMS_PLUS_ONE and name.endswith("norm.weight"):
                weight = cast(torch.Tensor, weight) - 1.0  # (the loader adds it back)
            elif name.endswith("shared_expert_gate.weight"):
                weight = cast(torch.Tensor, weight).reshape(1, -1)
            yield name, weight

    def _experts(
        self, tensor: Any, layer: int, matrix: str, keep_blocks: bool
    ) -> Iterator[tuple[str, Weight]]:
        """Each expert's matrix of an [experts, out, in] tensor (or bias of an [experts, out] one),
        under Qwen3-MoE's names: in its blocks where asked and the type is kept so (views of the
        file's mapping), else dequantized to float32."""
        kind = KEPT_IN_BLOCKS.get(tensor.tensor_type.name) if keep_blocks else None
        weights: list[Weight]
        if kind:
            rows = torch.from_numpy(_block_bytes(tensor))  # [E, out, bytes]
            weights = [QuantizedRows(kind, rows[e]) for e in range(rows.shape[0])]
        else:
            weights = list(self.dequantized(tensor))  # [out, in] each
        for e, weight in enumerate(weights):
            yield f"model.layers.{layer}.mlp.experts.{e}.{matrix}", weight

    def dequantized(self, tensor: Any) -> torch.Tensor:  # float32, exactly gguf's dequantization
        from gguf.quants import dequantize

        try:
            values = dequantize(tensor.data, tensor.tensor_type)
        except (ValueError, TypeError, IndexError) as exc:  # a truncated file, mostly
            raise GgufError(f"{self.path}: tensor {tensor.name!r} cannot be read ({exc})") from None
        values = np.ascontiguousarray(values, dtype=np.float32)
        if np.may_share_memory(values, tensor.data):  # F32 tensors come as views of the mapping
            return torch.from_numpy(values.copy())
        release_pages(tensor.data.ctypes.data, tensor.data.nbytes)  # read: weft/model/gguf_file.py
        return torch.from_numpy(values)

    def _blocks(self, tensor: Any, kind: str) -> QuantizedRows:
        return QuantizedRows(kind, torch.from_numpy(_block_bytes(tensor)))  # [rows, bytes per row]


def _block_bytes(tensor: Any) -> np.ndarray:
    """A quantized tensor's rows of blocks: a view of the mapping, read when they are packed."""
    return np.asarray(tensor.data, dtype=np.uint8)


__all__ = ["GgufCheckpoint", "GgufError", "hf_name", "is_gguf", "unpermute_rotary_rows"]
