"""A `tokenizers` tokenizer built from a GGUF file's `tokenizer.*` metadata, and the
tokenizer_config that goes with it (special tokens, BOS, the chat template).

GGUF stores a byte-level BPE tokenizer (`tokenizer.ggml.model == "gpt2"`) as its tokens, their types
(3 = control, 4 = user-defined: both become special added tokens), its merges and the name of its
pre-tokenizer (`tokenizer.ggml.pre`), whose splitting rule llama.cpp keeps in code: `PRE_TOKENIZERS`
holds the rules of the families weft runs, as the Hugging Face tokenizers of those families state
them. SentencePiece files (`"llama"`) are not built here: pass `tokenizer=` a Hugging Face tokenizer
directory for those.
"""

from __future__ import annotations

from typing import Any

from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers, processors
from tokenizers import Tokenizer as HFTokenizer

from weft.config import ConfigError

_LLAMA3 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)


def _split_then_bytes(pattern: str) -> pre_tokenizers.PreTokenizer:
    return pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(pattern), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )


def _pre_tokenizer(pre: str) -> tuple[pre_tokenizers.PreTokenizer, bool]:
    """The splitting rule of `tokenizer.ggml.pre`, and whether whole words skip the merges (Llama 3)."""
    if pre in ("default", "gpt2", "gpt-2"):
        return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True), False
    if pre == "smollm":
        digits = pre_tokenizers.Digits(individual_digits=True)
        return pre_tokenizers.Sequence([digits, pre_tokenizers.ByteLevel(add_prefix_space=False)]), False
    if pre in ("llama-bpe", "llama3", "llama-v3"):
        return _split_then_bytes(_LLAMA3), True
    if pre in ("qwen2", "deepseek-r1-qwen"):
        return _split_then_bytes(_QWEN2), False
    known = "default, gpt2, smollm, llama-bpe, qwen2"
    raise ConfigError(
        f"tokenizer.ggml.pre={pre!r}: weft does not know this pre-tokenizer (it knows {known}); "
        "pass tokenizer= a Hugging Face tokenizer directory of this model"
    )


def tokenizer_from_gguf(metadata: dict[str, Any], source: str) -> tuple[HFTokenizer, dict[str, Any]]:
    """The tokenizer and its tokenizer_config from a GGUF file's metadata (`source` names the file)."""
    kind = metadata.get("tokenizer.ggml.model")
    if kind != "gpt2":
        raise ConfigError(
            f"{source}: tokenizer.ggml.model={kind!r}: weft builds byte-level BPE tokenizers ('gpt2') from "
            "GGUF files; pass tokenizer= a Hugging Face tokenizer directory of this model"
        )
    tokens: list[str] = list(metadata["tokenizer.ggml.tokens"])
    merges = [tuple(merge.split(" ", 1)) for merge in metadata.get("tokenizer.ggml.merges", [])]
    pre, ignore_merges = _pre_tokenizer(str(metadata.get("tokenizer.ggml.pre", "default")))
    vocab = {token: i for i, token in enumerate(tokens)}
    tokenizer = HFTokenizer(models.BPE(vocab=vocab, merges=merges, ignore_merges=ignore_merges))
    tokenizer.pre_tokenizer = pre
    tokenizer.decoder = decoders.ByteLevel()
    if metadata.get("tokenizer.ggml.pre") in ("qwen2", "deepseek-r1-qwen"):
        tokenizer.normalizer = normalizers.NFC()
    types = metadata.get("tokenizer.ggml.token_type", [])
    special = [
        AddedToken(tokens[i], special=True, normalized=False) for i, t in enumerate(types) if t in (3, 4)
    ]
    tokenizer.add_special_tokens(special)
    config = _tokenizer_config(metadata, tokens)
    if config.get("add_bos_token") and config.get("bos_token"):
        bos = config["bos_token"]
        tokenizer.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, vocab[bos])]
        )
    return tokenizer, config


def _tokenizer_config(metadata: dict[str, Any], tokens: list[str]) -> dict[str, Any]:
    """tokenizer_config.json's fields that weft reads: bos/eos tokens, add_bos_token, chat_template."""

    def token(key: str) -> str | None:
        index = metadata.get(f"tokenizer.ggml.{key}_token_id")
        return tokens[index] if isinstance(index, int) and 0 <= index < len(tokens) else None

    config: dict[str, Any] = {"bos_token": token("bos"), "eos_token": token("eos")}
    config["add_bos_token"] = bool(metadata.get("tokenizer.ggml.add_bos_token", False))
    if "tokenizer.chat_template" in metadata:
        config["chat_template"] = str(metadata["tokenizer.chat_template"])
    return config


__all__ = ["tokenizer_from_gguf"]
