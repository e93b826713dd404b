"""The byte-level incremental detokenizer against `Tokenizer.decode` and the generic detokenizer,
on real tokenizers: text in pieces adds up to the whole, forks continue alike."""

from __future__ import annotations

import random

import pytest
from conftest import shared_data

from weft.detokenize import ByteLevelDetokenizer, new_detokenizer
from weft.engine.default_model import bundled_model_path
from weft.tokenizer import IncrementalDetokenizer, Tokenizer

TEXTS = [
    "Hello, world! Ça va? 你好, 世界 🙂🙃 — naïve café",
    "def f(x):\n    return x ** 2  # squares\n\n\tTabs\tand   spaces",
    "Emoji with joiners: 👩‍👩‍👧 and flags 🇫🇷🇯🇵; math ∑∫√∞",
]


@pytest.fixture(scope="module", params=["bundled", "llama3", "gpt2", "qwen2.5"])
def tokenizer(request) -> Tokenizer:
    if request.param == "bundled":
        return Tokenizer.from_dir(bundled_model_path())
    return Tokenizer.from_dir(shared_data(f"tokenizers/{request.param}"))


def pieces(detok, token_ids: list[int], rng: random.Random) -> str:
    out, i = [], 0
    while i < len(token_ids):
        step = rng.randint(1, 3)
        out.append(detok.update(token_ids[i : i + step]))
        i += step
    return "".join(out) + detok.flush()


def sequences(tokenizer: Tokenizer, rng: random.Random) -> list[list[int]]:
    """Real text, random ids (invalid UTF-8 among them) and special tokens."""
    special = sorted(tokenizer.tokenizer.get_added_tokens_decoder())[:3]
    vocab = tokenizer.vocab_size
    found = [tokenizer.encode(text, add_special_tokens=False) for text in TEXTS]
    found += [[rng.randrange(vocab) for _ in range(40)] for _ in range(20)]
    found.append(tokenizer.encode(TEXTS[0], add_special_tokens=False)[:5] + special + [rng.randrange(vocab)])
    return found


@pytest.mark.parametrize("skip_special", [True, False])
def test_byte_level_pieces_add_up_to_decode(tokenizer, skip_special):
    assert tokenizer.is_byte_level
    rng = random.Random(0)
    for ids in sequences(tokenizer, rng):
        prompt = tokenizer.encode("Prompt:", add_special_tokens=False)
        text = pieces(ByteLevelDetokenizer(tokenizer, prompt, skip_special), ids, rng)
        assert text == tokenizer.decode(ids, skip_special), ids


def test_byte_level_agrees_with_the_generic_detokenizer_on_text(tokenizer):
    rng = random.Random(1)
    for text in TEXTS:
        ids = tokenizer.encode(text, add_special_tokens=False)
        fast = pieces(new_detokenizer(tokenizer, [], True), ids, random.Random(2))
        generic = pieces(IncrementalDetokenizer(tokenizer, [], True), ids, rng)
        assert fast == generic == tokenizer.decode(ids)


def test_byte_level_never_emits_half_a_character(tokenizer):
    ids = tokenizer.encode("🙂", add_special_tokens=False)
    detok = ByteLevelDetokenizer(tokenizer, [], True)
    emitted = [detok.update([t]) for t in ids]
    assert "".join(emitted) == "🙂" and all(e in ("", "🙂") for e in emitted)


def test_byte_level_fork_continues_like_the_original(tokenizer):
    ids = tokenizer.encode(TEXTS[2], add_special_tokens=False)
    for cut in range(1, len(ids)):
        detok = ByteLevelDetokenizer(tokenizer, [], True)
        head = detok.update(ids[:cut])
        child = detok.fork()
        assert head + child.update(ids[cut:]) + child.flush() == tokenizer.decode(ids)
        assert head + detok.update(ids[cut:]) + detok.flush() == tokenizer.decode(ids)
