"""A `tokenizers` tokenizer built from a GGUF file's `tokenizer.*` metadata, and the
tokenizer_config that goes with it (special tokens, BOS, the chat template).

GGUF stores a byte-level BPE tokenizer (`tokenizer.ggml.model == "gpt2"`) as its tokens, their types
(3 = control, 4 = user-defined: both become special added tokens), its merges and the name of its
pre-tokenizer (`tokenizer.ggml.pre`), whose splitting rule llama.cpp keeps in code: `PRE_TOKENIZERS`
holds the rules of the families weft runs, as the Hugging Face tokenizers of those families state
them.

A SentencePiece BPE tokenizer (`"llama"`: Llama 2, Mistral, ...) is stored as its pieces, their
scores and types; SentencePiece merges the pair whose merged piece scores highest, so the BPE model
here gets every split of a piece into two pieces as a merge, ranked by that piece's score (what
Hugging Face's converters do), with byte fallback for the `<0xNN>` pieces, "▁" for spaces and one
before the text (`tokenizer.ggml.add_space_prefix`).
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
    if kind not in ("gpt2", "llama"):
        raise ConfigError(
            f"{source}: tokenizer.ggml.model={kind!r}: weft builds byte-level BPE ('gpt2') and SentencePiece "
            "BPE ('llama') tokenizers from GGUF files; pass tokenizer= a Hugging Face tokenizer directory"
        )
    tokens: list[str] = list(metadata["tokenizer.ggml.tokens"])
    vocab = {token: i for i, token in enumerate(tokens)}
    tokenizer = _byte_level_bpe(metadata, vocab) if kind == "gpt2" else _sentencepiece_bpe(metadata, tokens)
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


def _byte_level_bpe(metadata: dict[str, Any], vocab: dict[str, int]) -> HFTokenizer:
    merges = [tuple(merge.split(" ", 1)) for merge in metadata.get("tokenizer.ggml.merges", [])]
    pre, ignore_merges = _pre_tokenizer(str(metadata.get("tokenizer.ggml.pre", "default")))
    tokenizer = HFTokenizer(models.BPE(vocab=vocab, merges=merges, ignore_merges=ignore_merges))
    tokenizer.pre_tokenizer = pre
    tokenizer.decoder = decoders.ByteLevel()
    if metadata.get("tokenizer.ggml.pre") in ("qwen2", "deepseek-r1-qwen"):
        tokenizer.normalizer = normalizers.NFC()
    return tokenizer


_NORMAL = 1  # tokenizer.ggml.token_type of an ordinary piece (2: unknown, 3: control, 6: byte)


def _sentencepiece_bpe(metadata: dict[str, Any], tokens: list[str]) -> HFTokenizer:
    scores = list(metadata.get("tokenizer.ggml.scores", [0.0] * len(tokens)))
    types = list(metadata.get("tokenizer.ggml.token_type", [_NORMAL] * len(tokens)))
    vocab = {token: i for i, token in enumerate(tokens)}
    unknown = next((tokens[i] for i, t in enumerate(types) if t == 2), None)
    merges = _score_merges(tokens, scores, vocab)
    tokenizer = HFTokenizer(
        models.BPE(vocab=vocab, merges=merges, unk_token=unknown, fuse_unk=True, byte_fallback=True)
    )
    space: list[normalizers.Normalizer] = [normalizers.Replace(" ", "\u2581")]
    if metadata.get("tokenizer.ggml.add_space_prefix", True):
        space.insert(0, normalizers.Prepend("\u2581"))
    tokenizer.normalizer = normalizers.Sequence(space)
    tokenizer.decoder = decoders.Sequence(
        [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    return tokenizer


def _score_merges(tokens: list[str], scores: list[float], vocab: dict[str, int]) -> list[tuple[str, str]]:
    """Every split of a piece into two pieces, the best-scored merged pieces first (ties: in piece
    order, then by the halves' ids), as SentencePiece's BPE applies them."""
    merges: list[tuple[float, int, int, int, str, str]] = []
    for index, (piece, score) in enumerate(zip(tokens, scores, strict=True)):
        for cut in range(1, len(piece)):
            left, right = piece[:cut], piece[cut:]
            if left in vocab and right in vocab:
                merges.append((-score, index, vocab[left], vocab[right], left, right))
    merges.sort()
    return [(left, right) for *_, left, right in merges]


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
