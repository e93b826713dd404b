"""Tiny random Hugging Face checkpoints, built and saved by `transformers`, for the tests."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

TEXT = (
    "First Citizen: Before we proceed any further, hear me speak. All: Speak, speak. "
    "You are all resolved rather to die than to famish? Resolved. resolved. "
    "First, you know Caius Marcius is chief enemy to the people. We know't, we know't. "
    "Café naïve 你好 🙂 — numbers 12345 and    spaces.\n\n"
)

# architecture name -> (transformers config class name, extra config fields)
ARCHS: dict[str, tuple[str, dict[str, Any]]] = {
    "llama": ("LlamaConfig", {}),
    "llama3": (
        "LlamaConfig",
        {
            "rope_scaling": {
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            }
        },
    ),
    "llama-untied": ("LlamaConfig", {"tie_word_embeddings": False}),
    "mistral": ("MistralConfig", {"sliding_window": None}),
    "qwen2": ("Qwen2Config", {}),
    "qwen3": ("Qwen3Config", {"head_dim": 16}),
    # YaRN over an original context of 16 positions (the parity prompts reach 21)
    "qwen3-yarn": (
        "Qwen3Config",
        {
            "head_dim": 16,
            "max_position_embeddings": 64,
            "rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16},
        },
    ),
    "granite": (
        "GraniteConfig",
        {
            "embedding_multiplier": 3.0,
            "residual_multiplier": 0.5,
            "attention_multiplier": 0.2,
            "logits_scaling": 2.0,
        },
    ),
    "smollm3": ("SmolLM3Config", {"no_rope_layer_interval": 2}),  # its second layer without rotary embedding
    "olmo2": ("Olmo2Config", {}),
    # mixtures of 8 experts, 2 per token: Qwen3-MoE with normalised weights and its first layer dense,
    # Mixtral, OLMoE without normalising
    "qwen3moe": (
        "Qwen3MoeConfig",
        {
            "head_dim": 16,
            "num_experts": 8,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 32,
            "norm_topk_prob": True,
            "mlp_only_layers": [0],
        },
    ),
    # Qwen2-MoE: q/k/v biases, weights not normalised, a shared expert of 48 columns with its gate
    "qwen2moe": (
        "Qwen2MoeConfig",
        {
            "num_experts": 8,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 32,
            "shared_expert_intermediate_size": 48,
            "norm_topk_prob": False,
        },
    ),
    "mixtral": ("MixtralConfig", {"num_local_experts": 8, "num_experts_per_tok": 2, "sliding_window": None}),
    "olmoe": ("OlmoeConfig", {"num_experts": 8, "num_experts_per_tok": 2, "intermediate_size": 32}),
    # gpt-oss: 4 experts with biases and clamped SwiGLU, attention sinks, windows of 8 keys in every
    # other layer, YaRN over 16 original positions
    "gptoss": (
        "GptOssConfig",
        {
            "head_dim": 16,
            "num_local_experts": 4,
            "num_experts_per_tok": 2,
            "intermediate_size": 32,
            "num_hidden_layers": 4,
            "sliding_window": 8,
            "tie_word_embeddings": False,
            "rope_parameters": {
                "rope_type": "yarn",
                "rope_theta": 150000.0,
                "factor": 8.0,
                "original_max_position_embeddings": 16,
                "beta_fast": 32.0,
                "beta_slow": 1.0,
                "truncate": False,
            },
        },
    ),
    # Gemma 2: windows of 8 keys in every other layer, attention and final logits soft-capped (low
    # caps, so that they bind)
    "gemma2": (
        "Gemma2Config",
        {
            "architectures": ["Gemma2ForCausalLM"],
            "head_dim": 16,
            "num_hidden_layers": 4,
            "sliding_window": 8,
            "query_pre_attn_scalar": 24,
            "attn_logit_softcapping": 5.0,
            "final_logit_softcapping": 4.0,
        },
    ),
    # Gemma 3: windows of 8 keys in three layers of four (the third global), two rope bases
    "gemma3": (
        "Gemma3TextConfig",
        {
            "architectures": ["Gemma3ForCausalLM"],
            "head_dim": 16,
            "num_hidden_layers": 4,
            "sliding_window": 8,
            "layer_types": ["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"],
            "query_pre_attn_scalar": 24,
        },
    ),
    # Phi-4-mini's shape of rotary embedding: 3/4 of each head rotates, LongRoPE's short factors
    "phi3": (
        "Phi3Config",
        {
            "partial_rotary_factor": 0.75,
            "max_position_embeddings": 512,
            "original_max_position_embeddings": 64,
            "rope_scaling": {
                "rope_type": "longrope",
                "short_factor": [1.0, 1.1, 1.3, 1.6, 2.0, 2.5],
                "long_factor": [1.0, 2.0, 4.0, 8.0, 16.0, 32.0],
            },
        },
    ),
}


def train_tiny_tokenizer(vocab_size: int = 384) -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator([TEXT] * 4, trainer)
    return tok


def build_checkpoint(
    out: Path,
    arch: str = "llama",
    seed: int = 0,
    vocab_size: int = 384,
    dtype: str = "float32",
    **overrides: Any,
) -> Path:
    """Save a tiny random model of `arch` (a key of ARCHS), its weights stored in `dtype`, with a tiny
    BPE tokenizer to `out`."""
    import transformers

    config_cls_name, extra = ARCHS[arch]
    fields: dict[str, Any] = {
        "vocab_size": vocab_size,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 512,
        "rms_norm_eps": 1e-6,
        "tie_word_embeddings": True,
        "bos_token_id": 0,
        "eos_token_id": 0,
        "pad_token_id": 0,
    }
    fields.update(extra)
    fields.update(overrides)
    config = getattr(transformers, config_cls_name)(**fields)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config)
    with torch.no_grad():  # random init is tiny; widen it so that logits differ visibly
        for name, p in model.named_parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 0.2)
            elif arch.startswith("gemma") and name.endswith("norm.weight"):  # (Gemma's start at 0)
                p.uniform_(-0.5, 0.5)
            elif arch == "gptoss" and name.endswith(("sinks", "bias")):  # (they start at 0)
                p.normal_(0.0, 1.0 if name.endswith("sinks") else 0.2)
    model = model.to(getattr(torch, dtype))
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    tok = train_tiny_tokenizer(vocab_size)
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(
        '{"bos_token": "<|endoftext|>", "eos_token": "<|endoftext|>", "chat_template": '
        '"{% for m in messages %}<|im_start|>{{ m.role }}\\n{{ m.content }}<|im_end|>\\n{% endfor %}'
        '{% if add_generation_prompt %}<|im_start|>assistant\\n{% endif %}"}'
    )
    return out


def build_chat_checkpoint(
    out: Path, tokenizer_dir: Path, arch: str = "qwen2", seed: int = 0, max_positions: int = 4096
) -> Path:
    """A tiny random model over a real tokenizer (its tokenizer.json and tokenizer_config.json
    copied from `tokenizer_dir`), its vocabulary the tokenizer's rounded up to 64."""
    import json
    import shutil

    import transformers

    tok = Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json"))
    config = json.loads((tokenizer_dir / "tokenizer_config.json").read_text())
    eos = config.get("eos_token")
    eos = eos.get("content") if isinstance(eos, dict) else eos
    eos_id = tok.token_to_id(eos) if eos else 0
    vocab = -(-tok.get_vocab_size(with_added_tokens=True) // 64) * 64
    config_cls_name, extra = ARCHS[arch]
    fields: dict[str, Any] = {
        "vocab_size": vocab, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1,
        "num_attention_heads": 2, "num_key_value_heads": 1, "max_position_embeddings": max_positions,
        "tie_word_embeddings": True, "bos_token_id": eos_id, "eos_token_id": eos_id, **extra,
    }  # fmt: skip
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(getattr(transformers, config_cls_name)(**fields))
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    shutil.copy(tokenizer_dir / "tokenizer.json", out / "tokenizer.json")
    shutil.copy(tokenizer_dir / "tokenizer_config.json", out / "tokenizer_config.json")
    return out


def build_markov_checkpoint(out: Path, table: dict[str, dict[str, float]], hidden_size: int = 16) -> Path:
    """A Llama whose next-token logits depend on the last token alone, as `table` gives them:
    previous token -> {next token: logit}, tokens named by their text (single bytes, or
    "<|endoftext|>"); every other next token gets -1e4 (probability 0 in float32), and a previous
    token missing from the table gives uniform logits. The tokenizer is byte-level with no merges,
    so each character is one token. Attention and MLP write nothing (o_proj and down_proj are
    zero): the final hidden state is the normed embedding of the last token, which picks its
    row of the output projection."""
    import transformers

    tok = train_tiny_tokenizer(259)  # the 3 special tokens and the 256 bytes: no merges
    ids = {text: tok.token_to_id(text) for text in {t for row in table.values() for t in (*row, "")} if text}
    ids.update({prev: tok.token_to_id(prev) for prev in table})
    assert all(i is not None for i in ids.values()), "table tokens must be single bytes or special tokens"
    vocab = 320
    config = transformers.LlamaConfig(
        vocab_size=vocab, hidden_size=hidden_size, intermediate_size=32, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=256, rms_norm_eps=1e-6,
        tie_word_embeddings=False, bos_token_id=0, eos_token_id=0, pad_token_id=0,
    )  # fmt: skip
    model = transformers.LlamaForCausalLM(config)
    scale = hidden_size**0.5  # the final norm turns a one-hot embedding into sqrt(hidden) times it
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
        model.model.norm.weight.fill_(1.0)
        model.model.layers[0].input_layernorm.weight.fill_(1.0)
        model.model.layers[0].post_attention_layernorm.weight.fill_(1.0)
        assert len(table) < hidden_size
        for slot, (prev, row) in enumerate(table.items()):
            model.model.embed_tokens.weight[ids[prev], slot] = 1.0
            model.lm_head.weight[:, slot] = -1e4 / scale
            for text, logit in row.items():
                model.lm_head.weight[ids[text], slot] = logit / scale
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text('{"bos_token": "<|endoftext|>", "eos_token": "<|endoftext|>"}')
    return out
