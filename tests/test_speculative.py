"""Speculative decoding's proposers (issue #29): the n-gram prompt-lookup index against a brute-force
search of the same rule, and the configuration's checks."""

from __future__ import annotations

import random

import pytest

from weft.speculative.config import SpeculativeConfig
from weft.speculative.ngram import NgramIndex


def brute_force(tokens: list[int], min_n: int, max_n: int, k: int) -> list[int]:
    """The rule, searched directly: the longest suffix (max_n down to min_n) with an earlier
    occurrence, its latest one, then copy what followed it, the copy continuing into itself."""
    length = len(tokens)
    for n in range(min(max_n, length), min_n - 1, -1):
        suffix = tokens[length - n :]
        for end in range(length - 1, n - 1, -1):  # an occurrence ending before the last token
            if tokens[end - n : end] == suffix:
                out = list(tokens)
                for i in range(k):
                    out.append(out[end + i])
                return out[length:]
    return []


@pytest.mark.parametrize("vocab", [2, 3, 8])
@pytest.mark.parametrize("min_n,max_n", [(1, 1), (1, 3), (2, 4), (3, 3)])
def test_the_index_proposes_what_a_direct_search_finds(vocab, min_n, max_n):
    rng = random.Random(vocab * 100 + min_n * 10 + max_n)
    for _ in range(20):
        tokens = [rng.randrange(vocab) for _ in range(rng.randrange(0, 6))]
        index = NgramIndex(min_n, max_n, tokens)
        for _ in range(30):
            new = [rng.randrange(vocab) for _ in range(rng.choice([1, 1, 1, 3]))]
            tokens += new
            index.extend(new)
            k = rng.randrange(1, 7)
            assert index.propose(k) == brute_force(tokens, min_n, max_n, k), (tokens, k)


def test_a_copied_passage_is_guessed_and_a_period_continues():
    passage = [5, 6, 7, 8, 9, 10]
    index = NgramIndex(2, 4, [1, *passage, 2, 5, 6])
    assert index.propose(4) == [7, 8, 9, 10]
    assert NgramIndex(1, 3, [1, 2, 3, 1, 2, 3]).propose(7) == [1, 2, 3, 1, 2, 3, 1]
    assert NgramIndex(2, 3, [1, 2, 3, 4]).propose(3) == []  # nothing repeats


def test_the_configuration_is_vllms_shape_and_checked():
    config = SpeculativeConfig.of({"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_max": 4})
    assert (config.num_speculative_tokens, config.prompt_lookup_min, config.prompt_lookup_max) == (5, 2, 4)
    assert SpeculativeConfig.of({"prompt_lookup_max": 1}).prompt_lookup_min == 1
    for fields, match in [
        ({"method": "eagle"}, "weft has ngram"),
        ({"num_speculative_tokens": 0}, r"\[1, 16\]"),
        ({"prompt_lookup_min": 3, "prompt_lookup_max": 2}, "prompt_lookup_min <= prompt_lookup_max"),
        ({"draft_model": "x"}, "unknown keys draft_model"),
    ]:
        with pytest.raises(ValueError, match=match):
            SpeculativeConfig.of(fields)
