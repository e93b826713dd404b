"""Speculative decoding's proposers (issue #29): the n-gram prompt-lookup index against a brute-force
search of the same rule, and the configuration's checks."""

from __future__ import annotations

import json
import random

import pytest

from weft.config import SpeculativeConfig
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


def test_text_lookup_finds_words_tokenized_differently_where_they_are_copied():
    """` Menenius` after `name:` and `Menenius` inside a JSON string are different tokens: the
    token index has nothing, the text lookup continues the word from the record."""
    from weft.detokenize import token_bytes_for
    from weft.engine.default_model import bundled_model_path
    from weft.speculative.drafter import NgramDrafter
    from weft.speculative.text_lookup import TextLookup
    from weft.tokenizer import Tokenizer

    tok = Tokenizer.from_dir(bundled_model_path())
    record = "name: Menenius Agrippa\nage: 52\n"
    written = '{"name": "Menen'
    ids = tok.encode(record + written)
    assert NgramIndex(2, 4, ids).propose(4) == []  # nothing to copy at the token level
    drafter = NgramDrafter(
        2, 4, TextLookup(token_bytes_for(tok), lambda t: tok.encode(t, add_special_tokens=False))
    )
    guessed = drafter.propose(ids, 6)
    assert tok.decode(ids + guessed).startswith(record + '{"name": "Menenius Agrippa')
    # appended tokens are read incrementally
    more = tok.encode(" Agrippa", add_special_tokens=False)
    assert tok.decode(drafter.propose(ids + more, 2)).startswith("\n")


def test_field_lookup_drafts_the_value_a_json_key_names():
    """A record's `key: value` lines and the JSON that restates them: at a value's opening the
    drafter guesses the record's value (closed as a member that more follow: `",` after a string, `,`
    after a number), not what token or text
    lookup would; nothing where the key is not stated, the value is under way, or a JSON key is the
    only statement of it."""
    from weft.speculative.field_lookup import named_value

    record = b"name: Menenius Agrippa\nAge = 52\nhome: 'vienna'\n"
    assert named_value(record + b'{"name": "') == 'Menenius Agrippa",'
    assert named_value(record + b'{"name": "Menenius Agrippa", "age": ') == "52,"
    assert named_value(record + b'{"name": "Menenius Agrippa", "age": 52, "home": "') == 'vienna",'
    for tail in [b'{"name": "Men', b'{"nickname": "', b'{"name": "Menenius Agrippa"', b"{"]:
        assert named_value(record + tail) is None, tail
    assert named_value(b'{"home": "rome"}\n{"home": "') is None  # JSON keys state nothing
    assert named_value(b"home: rome\nhome: mantua\n" + b'{"home": "') == 'mantua",'  # the latest
    # before the value's first character: quoted unless bare JSON, after the space where it is due
    assert named_value(record + b'{"name": ') == '"Menenius Agrippa",'
    assert named_value(record + b'{"name":') == ' "Menenius Agrippa",'
    assert named_value(record + b'{"name": "Menenius Agrippa", "age":') == " 52,"
    assert named_value(b'ok: true\nhome: "rome"\n{"ok":') == " true,"
    assert named_value(b'ok: true\nhome: "rome"\n{"ok": true, "home":') == ' "rome",'


def test_the_drafter_guesses_a_named_value_before_anything_else():
    from weft.detokenize import token_bytes_for
    from weft.engine.default_model import bundled_model_path
    from weft.speculative.drafter import NgramDrafter
    from weft.speculative.text_lookup import TextLookup
    from weft.tokenizer import Tokenizer

    tok = Tokenizer.from_dir(bundled_model_path())
    ids = tok.encode('name: Romeo\nage: 17\nhome: verona\n{"name": "Romeo", "age": 17, "home": "')
    drafter = NgramDrafter(
        2, 4, TextLookup(token_bytes_for(tok), lambda t: tok.encode(t, add_special_tokens=False))
    )
    assert tok.decode(drafter.propose(ids, 8)) == 'verona",'
    assert drafter.propose(ids, 1) == tok.encode("verona", add_special_tokens=False)[:1]


def test_a_draft_runs_on_through_what_the_grammar_forces_to_the_next_named_value():
    """Under a JSON schema, a name's guess (`Romeo",`) is followed by the tokens the grammar forces
    after it (` "age": `), the age the record states, and so on, not by forced tokens that no guess
    follows; the forced positions are reported, the guesses stay within their number, and the
    matcher is left as it was."""
    from weft.detokenize import token_bytes_for
    from weft.engine.default_model import bundled_model_path
    from weft.params import StructuredKind, StructuredSpec
    from weft.speculative.drafter import NgramDrafter
    from weft.speculative.forced import through_forced
    from weft.speculative.text_lookup import TextLookup
    from weft.structured.llguidance_backend import LLGuidanceBackend
    from weft.tokenizer import Tokenizer

    tok = Tokenizer.from_dir(bundled_model_path())
    backend = LLGuidanceBackend(tok.tokenizer.to_str(), tok.vocab_size, [tok.eos_token_id or 0])
    schema = {
        "type": "object",
        "properties": {"name": {"type": "string"}, "age": {"type": "integer"}, "home": {"type": "string"}},
        "required": ["name", "age", "home"],
    }
    matcher = backend.new_matcher(
        backend.compile(StructuredSpec(StructuredKind.JSON_SCHEMA, json.dumps(schema)))
    )
    record = tok.encode("name: Romeo\nage: 17\nhome: verona\n")
    opened = tok.encode('{"name": "', add_special_tokens=False)
    assert matcher.consume(opened)
    drafter = NgramDrafter(
        2, 4, TextLookup(token_bytes_for(tok), lambda t: tok.encode(t, add_special_tokens=False))
    )
    ids = record + opened
    guessed = drafter.propose(ids, 8)
    assert tok.decode(guessed) == 'Romeo",'
    forced_before, valid_before = matcher.forced_tokens(), matcher.validate(guessed)
    draft, forced_at = through_forced(matcher, drafter.propose_after, ids, guessed, 8, 64)
    assert tok.decode(draft) == 'Romeo", "age": 17, "home": "verona'
    assert tok.decode([draft[i] for i in forced_at]) == ' "age":  "home": "'
    assert forced_at[0] == len(guessed) and len(draft) - len(forced_at) == 8  # guesses
    assert len(forced_at) == len(set(forced_at)) and forced_at == sorted(forced_at)
    assert (matcher.forced_tokens(), matcher.validate(guessed)) == (forced_before, valid_before)
    assert through_forced(matcher, drafter.propose_after, ids, guessed, len(guessed), 64) == (guessed, [])
    assert through_forced(matcher, None, ids, guessed, 8, 64) == (guessed, [])  # a drafter that cannot
    assert through_forced(matcher, lambda *_: [], ids, guessed, 8, 64) == (guessed, [])  # nothing after
    assert through_forced(matcher, drafter.propose_after, ids, guessed, 8, len(guessed) + 3) == (guessed, [])
    # where a token costs much of a step and the guesses so far are often wrong, it does not pay
    propose_after = drafter.propose_after
    assert through_forced(matcher, propose_after, ids, guessed, 8, 64, 0.7, 0.2) == (guessed, [])
    assert through_forced(matcher, propose_after, ids, guessed, 8, 64, 0.95, 0.2) == (draft, forced_at)


def test_the_step_cost_fit_recovers_what_a_token_costs():
    from weft.speculative.policy import StepCost

    cost = StepCost()
    assert 0 < cost.share(1) < cost.share(32) < 1  # the prior: a token costs a little, more at size
    for tokens in [1, 5, 2, 9, 3, 1, 8, 4] * 20:  # steps of 1 ms plus 0.05 ms a token
        cost.record(tokens, 1e-3 + 5e-5 * tokens)
    assert cost.share(1) == pytest.approx(5e-5 / 1.05e-3, rel=1e-3)
    assert cost.share(32) == pytest.approx(32 * 5e-5 / (1e-3 + 32 * 5e-5), rel=1e-3)
    flat = StepCost()
    for tokens in [1, 4, 7] * 30:  # a forward that costs the same whatever its tokens
        flat.record(tokens, 2e-3)
    assert flat.share(8) < 0.01  # (what is left of the prior)


def test_a_sequence_drafts_as_far_as_its_acceptance_pays():
    from weft.speculative.policy import PROBE_EVERY, Acceptance

    sure = Acceptance()
    for _ in range(20):
        sure.record(4, 4)
    assert sure.rate > 0.95 and sure.num_tokens(0.1, 8) == 8  # 0.95^8 > 0.1
    middling = Acceptance(accepted=7.0, tried=10.0)  # a = 0.7: 0.7^3 = 0.34 > 0.3 > 0.7^4 = 0.24
    assert middling.num_tokens(0.3, 8) == 3 and middling.num_tokens(0.8, 8) == 0
    hopeless = Acceptance()
    for _ in range(20):
        hopeless.record(4, 0)
    assert hopeless.rate < 0.05
    counts = [hopeless.num_tokens(0.1, 4) for _ in range(2 * PROBE_EVERY)]
    assert counts.count(1) == 2 and counts.count(0) == 2 * PROBE_EVERY - 2  # probes only
    assert Acceptance().num_tokens(0.0, 5) == 5  # free tokens: as many as allowed


def test_the_gate_measures_steps_with_forced_tokens_but_not_prompts():
    """A JSON step computes the tokens a grammar forced before its sampled one: the gate counts it
    as a step of its kind, producing the tokens it computes (forced ones included) and the drafts
    it keeps; a prompt's step is neither kind."""
    from types import SimpleNamespace

    from weft.config import SpeculativeConfig
    from weft.engine.speculation import Speculation
    from weft.speculative.policy import GATE_KNOWN_MOST

    def step(known: int, drafts: int) -> SimpleNamespace:
        item = SimpleNamespace(samples=True, num_new_tokens=known + drafts, drafts=[0] * drafts)
        return SimpleNamespace(scheduled=[item], num_batched_tokens=known + drafts)

    speculation = Speculation(SpeculativeConfig.of({"method": "ngram", "num_speculative_tokens": 4}))
    bucket = speculation.gate._bucket(1)
    speculation.observe(step(GATE_KNOWN_MOST + 1, 0), 1e-3)  # a prompt
    assert bucket.plain.steps == bucket.drafting.steps == 0
    speculation.observe(step(7, 0), 1e-3)  # 6 forced tokens, then the one they follow
    speculation.observe(step(7, 3), 2e-3)  # the same, and 3 drafts, none kept
    speculation.tally.add(3, 2, 1)  # 3 drafts, 2 guesses and a forced token kept
    speculation.observe(step(7, 3), 2e-3)
    assert (bucket.plain.steps, bucket.drafting.steps) == (1, 2)
    assert bucket.plain.tokens == 7 and bucket.drafting.tokens == pytest.approx(7 * 0.7 + 10)


def test_the_gate_lets_steps_draft_only_while_drafting_steps_are_faster():
    """Per batch size: drafting steps first, then plain ones, then whichever kind produced more
    tokens per second, with one step of the other kind every GATE_PROBE_EVERY steps times the
    square of its slowness (at most GATE_PROBE_MOST); a change in which kind is faster is followed,
    and batch sizes in one power of two share their measures."""
    from weft.speculative.policy import GATE_PROBE_EVERY, GATE_PROBE_MOST, DraftGate

    def run(gate: DraftGate, batch: int, steps: int, drafting_tps: float, plain_tps: float) -> list[bool]:
        allowed = []
        for _ in range(steps):
            drafts = gate.allows(batch)
            allowed.append(drafts)
            tokens = 2 * batch if drafts else batch
            gate.record(batch, tokens, tokens / (drafting_tps if drafts else plain_tps), drafted=drafts)
        return allowed

    gate = DraftGate()
    close = run(gate, 8, 8 + 100 * GATE_PROBE_EVERY, drafting_tps=700.0, plain_tps=800.0)
    assert close[:8] == [True] * 4 + [False] * 4  # each kind measured GATE_MIN_STEPS times
    every = round(GATE_PROBE_EVERY * (800 / 700) ** 2)
    assert close[8:].count(True) == pytest.approx(100 * GATE_PROBE_EVERY / every, abs=1)  # probes
    later = run(gate, 7, 8 * GATE_PROBE_EVERY, drafting_tps=1200.0, plain_tps=800.0)  # 7: 8's bucket
    tail = later[-4 * GATE_PROBE_EVERY :]
    assert 1 <= tail.count(False) <= 2  # drafting again, plain probed every 16 * 1.5^2 = 36 steps
    slow = run(DraftGate(), 1, 8 + 4 * GATE_PROBE_MOST, drafting_tps=900.0, plain_tps=100.0)
    assert slow[8:].count(False) == 4  # plain 9x slower: probed every GATE_PROBE_MOST steps only


def _brute_counts(outputs: list[list[int]], depth: int) -> dict[tuple[int, ...], dict[int, int]]:
    counts: dict[tuple[int, ...], dict[int, int]] = {}
    for tokens in outputs:
        for end in range(1, len(tokens)):
            for n in range(1, min(depth, end) + 1):
                follows = counts.setdefault(tuple(tokens[end - n : end]), {})
                follows[tokens[end]] = follows.get(tokens[end], 0) + 1
    return counts


def test_the_suffix_cache_counts_what_followed_and_forgets_the_oldest():
    from weft.speculative.suffix import SuffixCache

    rng = random.Random(3)
    outputs = [[rng.randrange(6) for _ in range(rng.randint(0, 30))] for _ in range(12)]
    cache = SuffixCache(depth=3, max_requests=5)
    for key, tokens in enumerate(outputs):
        cache.add(key, tokens)
        kept = [t for t in outputs[max(0, key - 4) : key + 1]]
        assert cache.counts.follows == _brute_counts(kept, 3)


def test_suffix_drafts_follow_the_most_frequent_continuation_while_it_is_likely():
    from weft.speculative.suffix import SuffixCache, SuffixDrafter

    cache = SuffixCache(depth=4, max_requests=10)
    call = [7, 8, 9, 10, 11, 12]  # an agent's tool call, made three times with one variation
    cache.add(0, [1, 2, *call, 3])
    cache.add(1, [4, *call, 5])
    cache.add(2, [6, 7, 8, 9, 20, 21])
    drafter = SuffixDrafter(cache, depth=4, min_prob=0.5, spec_factor=4.0)
    # after 7 8: 9 always (3/3), then 10 twice in three (p = 2/3), 11 and 12 always
    assert drafter.propose([30, 31, 7, 8], 8) == [9, 10, 11, 12]  # then 3 or 5: 1/3 < 0.5
    strict = SuffixDrafter(cache, depth=4, min_prob=0.7, spec_factor=4.0)
    assert strict.propose([30, 31, 7, 8], 8) == [9]  # 2/3 < 0.7 stops the walk
    short = SuffixDrafter(cache, depth=4, min_prob=0.5, spec_factor=1.0)
    assert short.propose([30, 31, 7, 8], 8) == [9, 10]  # at most the matched length (2)
    own = SuffixDrafter(SuffixCache(4, 10), depth=4, min_prob=0.1, spec_factor=2.0)
    assert own.propose([5, 6, 5, 6, 5], 4) == [6, 5, 6, 5]  # its own repetition (matched 3: up to 6)
