"""A GGUF file of a real model's shape with random weights in a quantized type's blocks, for
`weft bench throughput --gguf-type` (speed only: the values are random, the bytes and their layout
are those of a real file).

`q4_k_m` follows llama.cpp's Q4_K_M choice of types (`q5_k_m` its Q5_K_M, with Q5_K and the Q5_1
fallback): Q4_K everywhere, but Q6_K for the output matrix (the token embedding where it is tied)
and for attn_v and ffn_down in the layers its `use_more_bits` picks (the first and last eighth of
the layers, and every third between); rows that are not whole 256-feature super-blocks fall back as
llama.cpp's do (Q4_K to Q5_0, Q6_K to Q8_0). `q8_0`, `q4_0`: every matrix in that type. `mxfp4`
(gpt-oss, as the published gpt-oss files are): the experts in MXFP4 blocks (each block's E8M0
scale drawn from 2^-9 .. 2^-4), every other matrix in Q8_0. Each
block's float16 scales are drawn small and finite, its quants uniformly; norms are 1. `f16`:
float16 weights drawn normal (`stds`), the source from which llama.cpp's quantizer makes a file of
any type (benchmarks/make_quant_files.py). The file carries the configuration but no tokenizer: the
benchmark feeds token ids and names a word-level tokenizer of the vocabulary's size (`tokenizer=`).
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import numpy as np

from weft.kernels import GGUF_BLOCKS

# kind -> the byte offsets of its float16 scales within a block (the sizes: `GGUF_BLOCKS`)
SCALES = {
    "q8_0": (0,),
    "q4_0": (0,),
    "q5_0": (0,),
    "q4_1": (0, 2),  # d and m
    "q5_1": (0, 2),
    "q4_k": (0, 2),
    "q5_k": (0, 2),
    "q6_k": (208,),
    "q2_k": (80, 82),  # d and dmin
    "q3_k": (108,),
    "iq4_nl": (0,),
    "iq4_xs": (0,),
}
MIXES = ("q4_k_m", "q5_k_m", "q8_0", "q4_0", "f16", "mxfp4")
# llama.cpp's fallbacks where a matrix's rows are not whole 256-feature super-blocks
_FALLBACK = {"q4_k": "q5_0", "q5_k": "q5_1", "q6_k": "q8_0"}


def _more_bits(layer: int, num_layers: int) -> bool:
    """llama.cpp's use_more_bits: which layers' attn_v and ffn_down Q4_K_M keeps in Q6_K."""
    eighth = num_layers // 8
    return layer < eighth or layer >= 7 * num_layers // 8 or (layer - eighth) % 3 == 2


def tensor_kind(mix: str, name: str, layer: int, num_layers: int, features: int) -> str:
    if mix == "mxfp4":
        return "mxfp4" if name.endswith("_exps") else "q8_0"
    if mix not in ("q4_k_m", "q5_k_m"):
        return mix
    if name == "attn_qkv":  # llama.cpp's fused q|k|v: a k-quant above the mix's
        kind = "q5_k" if mix == "q4_k_m" else "q6_k"
        return _FALLBACK[kind] if features % 256 else kind
    six = name in ("output", "token_embd_tied") or (
        name.removesuffix("_exps") in ("attn_v", "ffn_down") and _more_bits(layer, num_layers)
    )  # (llama.cpp matches "ffn_down" within a name: a MoE layer's ffn_down_exps too)
    kind = "q6_k" if six else mix[:4]
    return _FALLBACK[kind] if features % 256 else kind


def random_blocks(
    kind: str, rows: int, features: int, rng: np.random.Generator, scale: tuple[float, float] = (1e-4, 1e-3)
) -> np.ndarray:
    """[rows, bytes] uint8: random blocks of `kind` whose float16 scales are drawn from `scale`."""
    block, size = GGUF_BLOCKS[kind]
    scales = SCALES[kind]
    if features % block:
        raise ValueError(f"{features} input features are not whole {kind} blocks of {block}")
    data = rng.integers(0, 256, size=(rows, features // block, size), dtype=np.uint8)
    for offset in scales:
        values = rng.uniform(*scale, size=(rows, features // block)).astype(np.float16)
        data[..., offset : offset + 2] = values.view(np.uint8).reshape(rows, -1, 2)
    return data.reshape(rows, -1)


def random_mxfp4(rows: int, features: int, rng: np.random.Generator) -> np.ndarray:
    """[rows, bytes] uint8: random MXFP4 blocks (an E8M0 scale byte, then 16 bytes of 4-bit codes)."""
    if features % 32:
        raise ValueError(f"{features} input features are not whole MXFP4 blocks of 32")
    data = rng.integers(0, 256, size=(rows, features // 32, 17), dtype=np.uint8)
    data[..., 0] = rng.integers(118, 124, size=(rows, features // 32), dtype=np.uint8)  # 2^-9 .. 2^-4
    return data.reshape(rows, -1)


# Hugging Face architecture -> llama.cpp's (the families whose shapes these files take)
GGUF_ARCHS = {
    "LlamaForCausalLM": "llama",
    "Qwen3ForCausalLM": "qwen3",
    "Gemma2ForCausalLM": "gemma2",
    "Gemma3ForCausalLM": "gemma3",
    "Qwen3MoeForCausalLM": "qwen3moe",
    "SmolLM3ForCausalLM": "smollm3",  # llama's tensors; every 4th layer without rotary embedding
    "GraniteForCausalLM": "granite",  # llama's tensors, and its four scales
    "GptOssForCausalLM": "gpt-oss",  # biases, sinks, YaRN, windows in every other layer, MXFP4 experts
    "Phi3ForCausalLM": "phi3",  # fused q|k|v and gate|up, partial rotary embedding, LongRoPE's factors
}
# Granite's scales: config.json key -> llama.cpp's key (under the architecture's name)
GRANITE_SCALES = {
    "embedding_multiplier": "embedding_scale",
    "residual_multiplier": "residual_scale",
    "attention_multiplier": "attention.scale",
    "logits_scaling": "logit_scale",
}


def write_random_gguf(
    config_path: Path,
    mix: str,
    out: Path,
    seed: int = 0,
    num_layers: int | None = None,
    stds: tuple[float, float] = (0.02, 0.02),
) -> Path:
    """Write `out`: the shape of `config_path` (a config.json of a family in `GGUF_ARCHS`; its
    first `num_layers` layers where given) in `mix` blocks (`f16`: float16 matrices drawn
    normal(0, stds[0]), the token embedding normal(0, stds[1])), with a vocabulary of placeholder
    tokens so that llama.cpp loads it too."""
    import gguf

    if mix not in MIXES:
        raise ValueError(f"--gguf-type {mix!r}: choose one of {', '.join(MIXES)}")
    config = json.loads(config_path.read_text())
    if num_layers is not None:
        config["num_hidden_layers"] = min(num_layers, config["num_hidden_layers"])
    arch = GGUF_ARCHS.get((config.get("architectures") or ["LlamaForCausalLM"])[0])
    if arch is None:
        raise ValueError(f"{config_path}: random GGUF files are written for {', '.join(GGUF_ARCHS)}")
    writer = gguf.GGUFWriter(str(out), arch)
    _write_config(writer, config, mix)
    _write_vocabulary(writer, config["vocab_size"])
    _write_tensors(writer, config, mix, arch, np.random.default_rng(seed), stds)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


def _write_config(writer: Any, config: dict[str, Any], mix: str) -> None:
    hidden, heads = config["hidden_size"], config["num_attention_heads"]
    head_dim = config.get("head_dim") or hidden // heads
    writer.add_context_length(config.get("max_position_embeddings", 2048))
    writer.add_embedding_length(hidden)
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(heads)
    writer.add_head_count_kv(config.get("num_key_value_heads", heads))
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    rope = _rope_scaling(config)
    writer.add_rope_freq_base(float(config.get("rope_theta", rope.get("rope_theta", 10000.0))))
    writer.add_layer_norm_rms_eps(float(config.get("rms_norm_eps", 1e-5)))
    writer.add_vocab_size(config["vocab_size"])
    writer.add_file_type({"q4_k_m": 15, "q5_k_m": 17, "q8_0": 7, "q4_0": 2, "f16": 1, "mxfp4": 38}[mix])
    _write_rope_scaling(writer, rope)
    if writer.arch == "phi3":
        _write_phi3_rope(writer, config, head_dim)
    if config.get("sliding_window") and config.get("layer_types"):
        writer.add_sliding_window(config["sliding_window"])
    if config.get("attn_logit_softcapping"):
        writer.add_attn_logit_softcapping(config["attn_logit_softcapping"])
    if config.get("final_logit_softcapping"):
        writer.add_final_logit_softcapping(config["final_logit_softcapping"])
    for key, gguf_key in GRANITE_SCALES.items():
        if key in config:
            writer.add_float32(f"{writer.arch}.{gguf_key}", float(config[key]))
    if _num_experts(config):
        writer.add_expert_count(_num_experts(config))
        writer.add_expert_used_count(config["num_experts_per_tok"])
        writer.add_expert_feed_forward_length(
            config.get("moe_intermediate_size", config["intermediate_size"])
        )


def _rope_scaling(config: dict[str, Any]) -> dict[str, Any]:
    return config.get("rope_scaling") or config.get("rope_parameters") or {}  # (transformers 5: the latter)


def _write_rope_scaling(writer: Any, scaling: dict[str, Any]) -> None:
    """YaRN's keys (gpt-oss's), as llama.cpp's converter writes them."""
    import gguf

    if scaling.get("rope_type", scaling.get("type")) != "yarn":
        return
    writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
    writer.add_rope_scaling_factor(float(scaling["factor"]))
    writer.add_rope_scaling_orig_ctx_len(int(scaling["original_max_position_embeddings"]))
    for key in ("beta_fast", "beta_slow"):
        if key in scaling:
            writer.add_float32(f"{writer.arch}.rope.scaling.yarn_{key}", float(scaling[key]))


def _write_phi3_rope(writer: Any, config: dict[str, Any], head_dim: int) -> None:
    """Phi-3's rotating share of each head and LongRoPE's keys, as llama.cpp's converter writes them
    (its factors are tensors: `_write_tensors`)."""
    writer.add_rope_dimension_count(int(head_dim * config.get("partial_rotary_factor", 1.0)))
    original = config.get("original_max_position_embeddings")
    if original:
        scale = config["max_position_embeddings"] / original
        writer.add_rope_scaling_orig_ctx_len(original)
        writer.add_rope_scaling_attn_factors(math.sqrt(1 + math.log(scale) / math.log(original)))


def _num_experts(config: dict[str, Any]) -> int:
    return int(config.get("num_experts") or config.get("num_local_experts") or 0)


def _write_vocabulary(writer: Any, vocab_size: int) -> None:
    """Placeholder tokens `<t{i}>` as a byte-level BPE vocabulary (the benchmark feeds token ids),
    the first three `<`, `t` and `<t` so that its one merge is of tokens it has (llama.cpp and weft
    both load it)."""
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(["<", "t", "<t", *(f"<t{i}>" for i in range(3, vocab_size))])
    writer.add_token_types([1] * vocab_size)
    writer.add_token_merges(["< t"])
    writer.add_bos_token_id(0)
    writer.add_eos_token_id(1)


def _write_tensors(
    writer: Any,
    config: dict[str, Any],
    mix: str,
    arch: str,
    rng: np.random.Generator,
    stds: tuple[float, float],
) -> None:
    import gguf

    hidden, layers, vocab = config["hidden_size"], config["num_hidden_layers"], config["vocab_size"]
    heads = config["num_attention_heads"]
    kv_heads = config.get("num_key_value_heads", heads)
    head_dim = config.get("head_dim") or hidden // heads
    tied = bool(config.get("tie_word_embeddings", False))

    def matrix(name: str, kind_name: str, layer: int, rows: int, features: int, experts: int = 0) -> None:
        if mix == "f16":
            std = stds[1] if name == "token_embd.weight" else stds[0]
            values = rng.normal(0.0, std, size=(max(experts, 1) * rows, features)).astype(np.float16)
            writer.add_tensor(name, values.reshape(experts, rows, -1) if experts else values)
            return
        kind = tensor_kind(mix, kind_name + ("_exps" if experts else ""), layer, layers, features)
        if kind == "mxfp4":
            blocks = random_mxfp4(rows * max(experts, 1), features, rng)
        else:
            blocks = random_blocks(kind, rows * max(experts, 1), features, rng)
        data = blocks.reshape(experts, rows, -1) if experts else blocks
        writer.add_tensor(name, data, raw_dtype=gguf.GGMLQuantizationType[kind.upper()])

    def ones(name: str, size: int) -> None:
        writer.add_tensor(name, np.ones(size, dtype=np.float32))

    matrix("token_embd.weight", "token_embd_tied" if tied else "token_embd", 0, vocab, hidden)
    if arch == "gpt-oss":
        _write_gpt_oss_layers(writer, config, matrix, rng)
        layers = 0
    if arch == "phi3":
        _write_phi3_layers(writer, config, matrix)
        layers = 0
    for i in range(layers):
        ones(f"blk.{i}.attn_norm.weight", hidden)
        ones(f"blk.{i}.ffn_norm.weight", hidden)
        if arch in ("qwen3", "qwen3moe", "gemma3"):
            ones(f"blk.{i}.attn_q_norm.weight", head_dim)
            ones(f"blk.{i}.attn_k_norm.weight", head_dim)
        if arch in ("gemma2", "gemma3"):
            ones(f"blk.{i}.post_attention_norm.weight", hidden)
            ones(f"blk.{i}.post_ffw_norm.weight", hidden)
        matrix(f"blk.{i}.attn_q.weight", "attn_q", i, heads * head_dim, hidden)
        matrix(f"blk.{i}.attn_k.weight", "attn_k", i, kv_heads * head_dim, hidden)
        matrix(f"blk.{i}.attn_v.weight", "attn_v", i, kv_heads * head_dim, hidden)
        matrix(f"blk.{i}.attn_output.weight", "attn_output", i, hidden, heads * head_dim)
        _write_mlp(writer, config, arch == "qwen3moe", i, matrix, rng)
    ones("output_norm.weight", hidden)
    if not tied:
        matrix("output.weight", "output", 0, vocab, hidden)


def _write_mlp(
    writer: Any, config: dict[str, Any], moe: bool, i: int, matrix: Any, rng: np.random.Generator
) -> None:
    """Layer i's MLP: gate, up and down, or (Qwen3-MoE) a router and its experts' three tensors."""
    hidden = config["hidden_size"]
    if not moe:
        inter = config["intermediate_size"]
        matrix(f"blk.{i}.ffn_gate.weight", "ffn_gate", i, inter, hidden)
        matrix(f"blk.{i}.ffn_up.weight", "ffn_up", i, inter, hidden)
        matrix(f"blk.{i}.ffn_down.weight", "ffn_down", i, hidden, inter)
        return
    experts, inter = _num_experts(config), config["moe_intermediate_size"]
    router = rng.normal(0.0, 0.02, size=(experts, hidden)).astype(np.float32)
    writer.add_tensor(f"blk.{i}.ffn_gate_inp.weight", router)
    matrix(f"blk.{i}.ffn_gate_exps.weight", "ffn_gate", i, inter, hidden, experts)
    matrix(f"blk.{i}.ffn_up_exps.weight", "ffn_up", i, inter, hidden, experts)
    matrix(f"blk.{i}.ffn_down_exps.weight", "ffn_down", i, hidden, inter, experts)


def _write_gpt_oss_layers(writer: Any, config: dict[str, Any], matrix: Any, rng: np.random.Generator) -> None:
    """gpt-oss's layers under llama.cpp's names: q/k/v/o with biases (zeros), each head's attention
    sink, post_attention_norm before the experts, a router with a bias, and the experts' gate, up and
    down matrices with biases (zeros)."""
    hidden, heads, kv_heads = (
        config["hidden_size"],
        config["num_attention_heads"],
        config["num_key_value_heads"],
    )
    head_dim, experts, inter = config["head_dim"], _num_experts(config), config["intermediate_size"]

    def floats(name: str, *shape: int, std: float = 0.0) -> None:
        writer.add_tensor(
            name, rng.normal(0.0, std, size=shape).astype(np.float32) if std else np.zeros(shape, np.float32)
        )

    for i in range(config["num_hidden_layers"]):
        writer.add_tensor(f"blk.{i}.attn_norm.weight", np.ones(hidden, dtype=np.float32))
        writer.add_tensor(f"blk.{i}.post_attention_norm.weight", np.ones(hidden, dtype=np.float32))
        for name, rows in (("q", heads * head_dim), ("k", kv_heads * head_dim), ("v", kv_heads * head_dim)):
            matrix(f"blk.{i}.attn_{name}.weight", f"attn_{name}", i, rows, hidden)
            floats(f"blk.{i}.attn_{name}.bias", rows)
        matrix(f"blk.{i}.attn_output.weight", "attn_output", i, hidden, heads * head_dim)
        floats(f"blk.{i}.attn_output.bias", hidden)
        floats(f"blk.{i}.attn_sinks.weight", heads, std=1.0)
        floats(f"blk.{i}.ffn_gate_inp.weight", experts, hidden, std=0.02)
        floats(f"blk.{i}.ffn_gate_inp.bias", experts)
        for name, rows, features in (("gate", inter, hidden), ("up", inter, hidden), ("down", hidden, inter)):
            matrix(f"blk.{i}.ffn_{name}_exps.weight", f"ffn_{name}", i, rows, features, experts)
            floats(f"blk.{i}.ffn_{name}_exps.bias", experts, rows)


def _write_phi3_layers(writer: Any, config: dict[str, Any], matrix: Any) -> None:
    """Phi-3's layers under llama.cpp's names: a fused q|k|v (`attn_qkv`), a fused gate|up
    (`ffn_up`, 2 x intermediate rows), and LongRoPE's long and short factors where the config has
    them."""
    hidden, heads, layers = config["hidden_size"], config["num_attention_heads"], config["num_hidden_layers"]
    kv_heads, inter = config.get("num_key_value_heads", heads), config["intermediate_size"]
    head_dim = config.get("head_dim") or hidden // heads
    scaling = _rope_scaling(config)
    for factors in ("long", "short"):
        if f"{factors}_factor" in scaling:
            values = np.asarray(scaling[f"{factors}_factor"], dtype=np.float32)
            writer.add_tensor(f"rope_factors_{factors}.weight", values)
    for i in range(layers):
        writer.add_tensor(f"blk.{i}.attn_norm.weight", np.ones(hidden, dtype=np.float32))
        writer.add_tensor(f"blk.{i}.ffn_norm.weight", np.ones(hidden, dtype=np.float32))
        matrix(f"blk.{i}.attn_qkv.weight", "attn_qkv", i, (heads + 2 * kv_heads) * head_dim, hidden)
        matrix(f"blk.{i}.attn_output.weight", "attn_output", i, hidden, heads * head_dim)
        matrix(f"blk.{i}.ffn_up.weight", "ffn_up", i, 2 * inter, hidden)
        matrix(f"blk.{i}.ffn_down.weight", "ffn_down", i, hidden, inter)


def word_level_tokenizer(vocab_size: int, out: Path) -> Path:
    """A directory with a tokenizer.json of one entry per id (the benchmark feeds token ids)."""
    from tokenizers import Tokenizer, models

    out.mkdir(parents=True, exist_ok=True)
    vocab = {f"<t{i}>": i for i in range(vocab_size)}
    Tokenizer(models.WordLevel(vocab, unk_token="<t0>")).save(str(out / "tokenizer.json"))
    return out
