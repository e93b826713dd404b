"""Speculative decoding in the engine: drafts verified in one forward give exactly the outputs of
decoding without them (tokens, text, logprobs, finish reasons), whatever the drafts are: all right
(an oracle that knows the output), all wrong, partly right, random, or prompt lookup's."""

from __future__ import annotations

import itertools
import math
import random
from collections.abc import Callable, Sequence

import pytest
import torch
from test_sampler import assert_matches

import weft.engine.engine as engine_module
from weft import LLM, OutputKind, SamplingParams, bundled_model_path
from weft.engine.engine import LLMEngine
from weft.model.layers import Linear
from weft.speculative.drafter import Drafter
from weft.structured.llguidance_backend import LLGuidanceMatcher

PROMPTS = [
    "First Citizen:\nBefore we proceed any further, hear me speak.\nFirst Citizen:\nBefore we",
    "ROMEO:",
    "All:\nSpeak, speak. Speak, speak.",
    "Second Citizen:\nOne word, good citizens.",
]
OPTIONS = {"show_progress": False, "device": "cpu", "dtype": "float32", "num_kv_blocks": 96}
K = 4


def add_bias(token_ids: list[int], logits: torch.Tensor) -> torch.Tensor:
    """A logits processor that reads the history (as logit_bias with a twist)."""
    logits = logits.clone()
    logits[7] += 2.0 + 0.1 * len(token_ids)
    return logits


def requests() -> list[tuple[str, SamplingParams]]:
    """One of each thing a row's token depends on, over the prompts."""
    params = [
        SamplingParams(temperature=0, max_tokens=40, logprobs=3),
        SamplingParams(temperature=0.9, top_p=0.9, top_k=40, seed=11, max_tokens=30, prompt_logprobs=2),
        SamplingParams(temperature=1.0, seed=12, max_tokens=30, stop=["e ", "th"], logprobs=2),
        SamplingParams(temperature=0.7, seed=13, max_tokens=25, min_tokens=12, stop_token_ids=[5, 9, 17]),
        SamplingParams(temperature=1.0, min_p=0.1, seed=14, max_tokens=26, n=3, logprobs=0),
        SamplingParams(temperature=0.8, seed=15, max_tokens=24, best_of=3, n=2),
        SamplingParams(
            temperature=0.8,
            seed=16,
            max_tokens=30,
            presence_penalty=0.8,
            repetition_penalty=1.3,
            frequency_penalty=0.4,
        ),
        SamplingParams(temperature=0.9, seed=17, max_tokens=30, logits_processors=[add_bias]),
        SamplingParams(
            temperature=0.8, seed=18, max_tokens=24, regex="[a-z]{2,12}( [a-z]{2,12})*", logprobs=1
        ),
        SamplingParams(temperature=0, max_tokens=40, json_schema=SCHEMA, logprobs=2, logprobs_mode="masked"),
        SamplingParams(temperature=1.0, seed=19, max_tokens=12, choice=["speak, speak", "peace, peace"]),
        SamplingParams(temperature=0.6, seed=20, max_tokens=30, logprobs=2, logprobs_mode="processed"),
    ]
    return [(PROMPTS[i % len(PROMPTS)], p) for i, p in enumerate(params)]


SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 12}, "age": {"type": "integer"}},
    "required": ["name", "age"],
}


class Oracle:
    """Drafts from known outputs: the continuation of whichever reference the sequence follows,
    changed by `spoil` (all right, all wrong, partly right)."""

    def __init__(self, references: list[list[int]], spoil: Callable[[list[int]], list[int]]) -> None:
        self.references, self.spoil = references, spoil

    def propose(self, token_ids: Sequence[int], k: int) -> list[int]:
        n = len(token_ids)
        for ref in self.references:
            if len(ref) > n and ref[:n] == list(token_ids):
                return self.spoil(ref[n : n + k])
        return []


class RandomDrafts:
    def __init__(self, rng: random.Random, vocab: int) -> None:
        self.rng, self.vocab = rng, vocab

    def propose(self, token_ids: Sequence[int], k: int) -> list[int]:
        return [self.rng.randrange(self.vocab) for _ in range(self.rng.randint(0, k))]


def run(engine: LLMEngine, reqs: list[tuple[str, SamplingParams]], abort: dict[str, int] | None = None):
    """Every request at once, stepped to the end; `abort`: request id -> the step that aborts it."""
    for _, params in reqs:  # compiled before the first step, so the steps do not depend on timing
        if params.structured is not None and not params.exact_choice:
            engine.grammars.validate(params.structured)
    for i, (prompt, params) in enumerate(reqs):
        engine.add_request(f"r{i}", prompt, params.replace(output_kind=OutputKind.FINAL_ONLY))
    finished, step = [], 0
    while engine.has_unfinished_requests():
        finished += engine.step()
        step += 1
        for request_id, at in (abort or {}).items():
            if at == step:
                engine.abort_request(request_id)
    assert engine.kv.num_used_blocks == 0 and not engine.scheduler.running and not engine.scheduler.waiting
    return sorted(finished, key=lambda o: o.request_id)


def fields(outputs) -> list[tuple]:
    return [
        (
            o.request_id,
            o.prompt_logprobs,
            c.index,
            c.token_ids,
            c.text,
            c.finish_reason,
            c.stop_reason,
            c.cumulative_logprob,
            c.logprobs,
            c.constraint_logmass,
            c.text_offsets,
            c.forced,
            c.error,
        )
        for o in outputs
        for c in o.outputs
    ]


@pytest.fixture(scope="module")
def engines(tiny_llama) -> tuple[LLMEngine, LLMEngine]:
    """The same model without and with speculation."""
    off = LLM(str(tiny_llama), **OPTIONS).engine
    on = LLM(str(tiny_llama), speculative_config={"num_speculative_tokens": K}, **OPTIONS).engine
    eager(on)
    return off, on


def eager(engine: LLMEngine) -> None:
    """Every proposed draft verified: the drafting policy (tested on its own) off."""
    assert engine.speculation is not None
    engine.speculation.adaptive = False


@pytest.fixture(scope="module")
def expected(engines) -> list:
    return run(engines[0], requests())


def _references(outputs) -> list[list[int]]:
    return [o.prompt_token_ids + c.token_ids for o in outputs for c in o.outputs]


def _all_wrong(guess: list[int]) -> list[int]:
    return [(t + 1) % 384 for t in guess]


def _partly_right(rng: random.Random) -> Callable[[list[int]], list[int]]:
    def spoil(guess: list[int]) -> list[int]:
        cut = rng.randint(0, len(guess))
        return guess[:cut] + [(t + 7) % 384 for t in guess[cut:]]

    return spoil


@pytest.mark.parametrize("drafts", ["right", "wrong", "partly", "random", "ngram"])
def test_outputs_are_those_of_decoding_without_speculation(engines, expected, drafts):
    _, on = engines
    rng = random.Random(5)
    references = _references(expected)
    make: Callable[[], Drafter] | None = {
        "right": lambda: Oracle(references, list),
        "wrong": lambda: Oracle(references, _all_wrong),
        "partly": lambda: Oracle(references, _partly_right(rng)),
        "random": lambda: RandomDrafts(rng, 384),
        "ngram": None,
    }[drafts]
    speculation = on.speculation
    assert speculation is not None
    default = speculation.new_drafter
    speculation.new_drafter = make or default
    before = speculation.tally.counts
    try:
        got = run(on, requests())
    finally:
        speculation.new_drafter = default
    assert fields(got) == fields(expected)
    done = speculation.tally.counts
    num_drafted = done.num_draft_tokens - before.num_draft_tokens
    num_accepted = done.num_accepted_tokens - before.num_accepted_tokens
    if drafts == "right":  # all but a few: samples of one request share prefixes (the oracle
        # may follow the wrong one), and tokens a grammar forces end a run
        assert num_drafted > 100 and num_accepted >= 0.95 * num_drafted
    if drafts == "wrong":
        assert num_drafted > 100 and num_accepted == 0
    if drafts == "partly":
        assert 0 < num_accepted < num_drafted
    per_request = [o.speculation for o in got]
    assert sum(c.num_accepted_tokens for c in per_request if c is not None) == num_accepted


def test_suffix_decoding_learns_from_earlier_outputs_and_changes_none(engines, expected, tiny_llama):
    """Suffix decoding: the same outputs; a second run of the same requests drafts from the
    first run's outputs (the cache of recent outputs) and accepts far more."""
    on = LLM(str(tiny_llama), speculative_config={"method": "suffix", "num_speculative_tokens": K}, **OPTIONS)
    eager(on.engine)
    first = run(on.engine, requests())
    assert fields(first) == fields(expected)
    accepted_first = on.engine.speculation.tally.num_accepted_tokens  # type: ignore[union-attr]
    again = run(on.engine, requests())
    assert fields(again) == fields(expected)
    accepted_again = on.engine.speculation.tally.num_accepted_tokens - accepted_first  # type: ignore[union-attr]
    assert accepted_again > 2 * accepted_first + 50


def test_right_drafts_take_fewer_steps(engines, expected):
    """The point of it all: with right drafts, k + 1 tokens per step."""
    _, on = engines
    speculation = on.speculation
    assert speculation is not None
    default = speculation.new_drafter
    references = _references(expected)
    speculation.new_drafter = lambda: Oracle(references, list)
    prompt, params = PROMPTS[0], SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    try:
        on.add_request("one", prompt, params)
        outputs = []
        while on.has_unfinished_requests():
            outputs += on.step()
    finally:
        speculation.new_drafter = default
    final = outputs[-1]
    assert len(final.outputs[0].token_ids) == 40
    counts = final.speculation
    assert counts is not None
    # the prompt's step samples one token; every later step verifies K drafts and gains K + 1
    assert len(outputs) <= 1 + -(-39 // (K + 1)) and counts.mean_accepted_length > K
    assert counts.acceptance_rate == 1.0


@pytest.mark.parametrize("opens_every", [0, 3], ids=["closed", "opens-every-third-step"])
def test_steps_stay_in_flight_while_the_gate_keeps_drafting_off(
    tiny_llama, expected, opens_every, monkeypatch
):
    """With lookahead on, a step after which the gate keeps drafting off stays in flight, as without
    speculation; a step the gate opens reads the one before back first (its drafts need the
    tokens). Either way the outputs are those of decoding without speculation."""
    speculative = {"num_speculative_tokens": K}
    engine = LLM(str(tiny_llama), speculative_config=speculative, async_scheduling=True, **OPTIONS).engine
    assert engine.speculation is not None
    asked = itertools.count(1)
    engine.speculation.gate.allows = lambda batch: opens_every > 0 and next(asked) % opens_every == 0
    committed: list[bool] = []
    real_commit = engine_module.commit

    def counted(launched):
        committed.append(any(item.drafts for item in launched.sched.scheduled))
        return real_commit(launched)

    monkeypatch.setattr(engine_module, "commit", counted)
    assert fields(run(engine, requests())) == fields(expected)
    assert committed and not any(committed)  # steps stayed in flight, never one that verified drafts
    assert (engine.speculation.tally.num_drafts > 0) == (opens_every > 0)


@pytest.mark.parametrize("constrained", [False, True], ids=["text", "json-chained"])
def test_preemption_and_aborts_leak_nothing(tiny_llama, constrained):
    """A cache too small for every sequence at once (preemptions while drafts are in the step)
    and requests aborted mid-way: the outputs of the others are unchanged, no block is left; also
    with JSON drafts that run on through forced tokens."""
    small = {**OPTIONS, "num_kv_blocks": 16, "max_model_len": 256}
    off = LLM(str(tiny_llama), **small).engine
    on = LLM(str(tiny_llama), speculative_config={"num_speculative_tokens": 6}, **small).engine
    eager(on)
    schema = {"json_schema": SCHEMA} if constrained else {}
    reqs = [
        (p, SamplingParams(temperature=0.8, seed=30 + i, max_tokens=48, **schema))
        for i, p in enumerate(PROMPTS * 2)
    ]
    abort = {"r1": 5, "r6": 9}
    expected = run(off, reqs, abort)
    rng = random.Random(1)
    references = _references(expected)

    def spoil(guess: list[int]) -> list[int]:  # cut short, so that some end where forced tokens start
        guess = guess[: rng.randint(1, max(len(guess), 1))]
        return guess if rng.random() < 0.5 else _partly_right(rng)(guess)

    chaining: list[ChainingOracle] = []

    def drafter() -> Oracle:
        if not constrained:
            return Oracle(references, spoil)
        chaining.append(ChainingOracle(references, spoil))
        return chaining[-1]

    on.speculation.new_drafter = drafter  # type: ignore[union-attr]
    got = run(on, reqs, abort)
    assert not constrained or sum(o.chained for o in chaining) > 0
    assert fields(got) == fields(expected)
    assert on.scheduler.num_preemptions > 0


def test_a_matcher_consumes_only_the_tokens_it_keeps(engines, expected, monkeypatch):
    """Under a grammar, drafts are checked without advancing the matcher: every token a matcher
    consumes is one its sequence keeps (sampled or forced), none is rolled back."""
    _, on = engines
    consumed: dict[int, int] = {}
    rollbacks = []
    original_consume = LLGuidanceMatcher.consume

    def consume(self, token_ids):
        consumed[id(self)] = consumed.get(id(self), 0) + len(token_ids)
        return original_consume(self, token_ids)

    monkeypatch.setattr(LLGuidanceMatcher, "consume", consume)
    monkeypatch.setattr(LLGuidanceMatcher, "rollback", lambda self, n: rollbacks.append(n))
    references = _references(expected)
    speculation = on.speculation
    assert speculation is not None
    default = speculation.new_drafter
    rng = random.Random(9)
    speculation.new_drafter = lambda: Oracle(references, _partly_right(rng))
    constrained = [r for r in requests() if r[1].structured is not None and not r[1].exact_choice]
    try:
        got = run(on, constrained)
    finally:
        speculation.new_drafter = default
    assert not rollbacks
    kept = sum(len(c.token_ids) for o in got for c in o.outputs if c.finish_reason != "error")
    assert sum(consumed.values()) == kept
    assert sum(o.speculation.num_accepted_tokens for o in got if o.speculation) > 0


class ChainingOracle(Oracle):
    """An oracle that also guesses past the tokens a grammar forces (`propose_after`), and counts
    the drafts that ran on through them."""

    def __init__(self, references: list[list[int]], spoil: Callable[[list[int]], list[int]]) -> None:
        super().__init__(references, spoil)
        self.chained = 0

    def propose_after(self, token_ids: Sequence[int], draft: list[int], k: int) -> list[int]:
        guessed = self.propose([*token_ids, *draft], k)
        self.chained += bool(guessed)
        return guessed


def _json_requests(n: int) -> list[tuple[str, SamplingParams]]:
    """Structured requests without logprobs (whose drafts may run on through forced tokens); `n`
    samples of one (an oracle may then follow the other sample while they share a prefix)."""
    params = [
        SamplingParams(temperature=0, max_tokens=40, json_schema=SCHEMA),
        SamplingParams(temperature=0.9, seed=21, max_tokens=40, json_schema=SCHEMA, n=n),
        SamplingParams(
            temperature=0.8, seed=22, max_tokens=30, regex=r"(ab|cd): [a-z]{1,4}(, (ab|cd): [a-z]{1,4})*"
        ),
    ]
    return [(PROMPTS[i % len(PROMPTS)], p) for i, p in enumerate(params)]


def test_long_verifying_rows_compute_what_decoding_does(tiny_llama, engines, expected):
    """With 12 drafts a verifying row holds 13 tokens, more than the kernels attend token by token
    in a prompt (this model shares KV heads): rows of generated tokens still attend token by token,
    so every logprob is the very number decoding computes (the outputs are compared bit for bit)."""
    on = LLM(str(tiny_llama), speculative_config={"num_speculative_tokens": 12}, **OPTIONS).engine
    eager(on)
    speculation = on.speculation
    assert speculation is not None
    speculation.new_drafter = lambda: Oracle(_references(expected), list)
    got = run(on, requests())
    assert fields(got) == fields(expected)
    assert speculation.tally.num_accepted_tokens > 100


def test_verifying_rows_never_take_the_prefill_gemm(checkpoint_factory):
    """Where a step's row count reaches a matrix's GEMM threshold (`Linear.dense_rows`, measured per
    machine: from 128-256 rows on AVX2 CPUs, so a batch of 32 with 4 drafts each), verifying rows
    still multiply through the panels, as decoding does: the outputs stay bit for bit the same. A
    model of 256 inputs, where the GEMM's sums differ from the panels'; thresholds of 2 rows."""
    checkpoint = str(checkpoint_factory("llama", hidden_size=256, intermediate_size=512))
    off = LLM(checkpoint, **OPTIONS).engine
    on = LLM(checkpoint, speculative_config={"num_speculative_tokens": K}, **OPTIONS).engine
    eager(on)
    for engine in (off, on):
        model = engine.model
        for module in model.modules():
            if isinstance(module, Linear) and module is not model.lm_head:
                module.dense_rows = 2
    reqs = [r for r in requests() if r[1].structured is None]
    expected = run(off, reqs)
    speculation = on.speculation
    assert speculation is not None
    speculation.new_drafter = lambda: Oracle(_references(expected), list)
    assert fields(run(on, reqs)) == fields(expected)
    assert speculation.tally.num_accepted_tokens > 100


def _counting_steps(engine: LLMEngine, reqs: list[tuple[str, SamplingParams]], make: Callable[[], Drafter]):
    """`run` with `make`'s drafters: the outputs and the number of steps."""
    speculation = engine.speculation
    assert speculation is not None
    default, speculation.new_drafter = speculation.new_drafter, make
    steps = itertools.count()
    step = engine.step
    engine.step = lambda: next(steps) is None or step()  # type: ignore[method-assign]
    try:
        return run(engine, reqs), next(steps)
    finally:
        speculation.new_drafter = default
        del engine.step


@pytest.mark.parametrize("spoil", ["right", "partly"])
def test_drafts_through_forced_tokens_change_no_output(engines, spoil):
    """Guesses that go on past the tokens a grammar forces after them (weft/speculative/forced.py)
    give the outputs of decoding without speculation, in fewer steps when they are right; the
    forced tokens a draft held count neither as drafted nor as accepted."""
    off, on = engines
    reqs = _json_requests(1 if spoil == "right" else 2)
    expected = run(off, reqs)
    references = _references(expected)
    speculation = on.speculation
    assert speculation is not None
    rng = random.Random(4)
    oracles: list[ChainingOracle] = []

    def shortened(guess: list[int]) -> list[int]:  # some end where the grammar forces what follows
        guess = guess[: 1 + sum(guess) % max(len(guess), 1)]  # (the same cut in both runs below)
        return guess if spoil == "right" or rng.random() < 0.5 else _partly_right(rng)(guess)

    def make() -> ChainingOracle:
        oracles.append(ChainingOracle(references, shortened))
        return oracles[-1]

    before = speculation.tally.counts
    got, steps = _counting_steps(on, reqs, make)
    assert fields(got) == fields(expected)
    assert sum(o.chained for o in oracles) > 0
    done = speculation.tally.counts
    num_drafted = done.num_draft_tokens - before.num_draft_tokens
    num_accepted = done.num_accepted_tokens - before.num_accepted_tokens
    if spoil == "partly":
        assert 0 < num_accepted < num_drafted
        return
    assert num_accepted == num_drafted > 0  # the forced tokens in the drafts: in neither count
    got, unchained_steps = _counting_steps(on, reqs, lambda: Oracle(references, shortened))
    assert fields(got) == fields(expected)
    assert steps < unchained_steps


def test_unseeded_sampling_at_a_draft_position_has_the_model_distribution(tiny_llama):
    """Unseeded, the token sampled at a draft's row follows the model's distribution there:
    chi-square against the probabilities of a forward over the prompt and the draft. (Two pinned
    tokens, then a third sampled at the row of the draft that repeats the second.)"""
    llm = LLM(str(tiny_llama), speculative_config={"num_speculative_tokens": 1}, **OPTIONS)
    eager(llm.engine)
    prompt = llm.tokenizer.encode(PROMPTS[1])
    pinned = [40, 11]

    class RepeatPinned:
        def propose(self, token_ids: Sequence[int], k: int) -> list[int]:
            return [pinned[1]] if len(token_ids) == len(prompt) + 1 else []

    speculation = llm.engine.speculation
    assert speculation is not None
    speculation.new_drafter = RepeatPinned
    params = SamplingParams(temperature=1.0, top_k=8, max_tokens=3, logits_processors=[_pin(pinned)])
    counts = torch.zeros(384, dtype=torch.float64)
    for o in llm.generate([prompt] * 2000, params):
        ids = o.outputs[0].token_ids
        assert ids[:2] == pinned
        counts[ids[2]] += 1
    assert speculation.tally.num_accepted_tokens == 2000  # every third token came from a draft row
    reference = llm.generate([[*prompt, *pinned]], SamplingParams(temperature=0, max_tokens=1, logprobs=8))
    probs = torch.zeros(384, dtype=torch.float64)
    for token, logprob in reference[0].outputs[0].logprobs[0].items():
        probs[token] = math.exp(logprob.logprob)
    assert_matches(counts, probs / probs.sum())


def _pin(tokens: list[int]):
    """A processor that makes the first output tokens `tokens`."""

    def processor(token_ids: list[int], logits: torch.Tensor) -> torch.Tensor:
        if len(token_ids) >= len(tokens):
            return logits
        out = torch.full_like(logits, float("-inf"))
        out[tokens[len(token_ids)]] = 0.0
        return out

    return processor


# ---- the bundled model, the configuration, the server --------------------------------------------


@pytest.fixture(scope="module")
def bundled() -> tuple[LLM, LLM]:
    on = LLM(bundled_model_path(), show_progress=False, speculative_config={"num_speculative_tokens": 4})
    eager(on.engine)
    return LLM(bundled_model_path(), show_progress=False), on


def test_the_bundled_model_decodes_the_same_with_prompt_lookup(bundled):
    off, on = bundled
    text = "ROMEO:\nBut soft, what light through yonder window breaks?\nROMEO:\nBut soft, what"
    params = [
        SamplingParams(temperature=0, max_tokens=48, logprobs=2),
        SamplingParams(temperature=0.8, seed=4, max_tokens=48, top_p=0.95, logprobs=1),
        SamplingParams(temperature=0, max_tokens=32, regex="[A-Za-z ,]+\n"),
    ]
    expected = off.generate([text] * len(params), params)
    got = on.generate([text] * len(params), params)
    assert fields(got) == fields(expected)
    assert sum(o.speculation.num_accepted_tokens for o in got if o.speculation) > 0


def test_an_extraction_drafts_its_values_while_the_gate_is_closed(bundled, monkeypatch):
    """A JSON extraction from a record of `key: value` lines drafts the values the record states
    even while the step gate keeps drafting off (the gate measures steps and cannot tell the few
    where a value opens), and no step stays in flight while it runs; a free-text request under the
    same closed gate drafts nothing and its steps stay in flight. Outputs as without drafts."""
    off, _ = bundled
    on = LLM(
        bundled_model_path(), show_progress=False, async_scheduling=True,
        speculative_config={"num_speculative_tokens": 4},
    )  # fmt: skip
    speculation = on.engine.speculation
    assert speculation is not None
    monkeypatch.setattr(speculation.gate, "allows", lambda batch: False)
    committed: list[bool] = []
    real_commit = engine_module.commit
    monkeypatch.setattr(
        engine_module, "commit", lambda launched: committed.append(True) or real_commit(launched)
    )
    schema = {
        "type": "object",
        "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
        "required": ["name", "age"],
    }
    record = "name: Romeo\nage: 17\n"
    extraction = SamplingParams(temperature=0, max_tokens=24, json_schema=schema)
    for prompt, params, drafts in [
        (record, extraction, True),
        ("ROMEO:\nBut soft, what light", SamplingParams(temperature=0, max_tokens=16), False),
    ]:
        before, committed[:] = speculation.tally.num_drafts, []
        (got,) = on.generate([prompt], params)
        (expected,) = off.generate([prompt], params)
        assert got.outputs[0].token_ids == expected.outputs[0].token_ids
        assert (speculation.tally.num_drafts > before) == drafts
        assert bool(committed) != drafts  # in flight only where nothing drafts


def test_a_request_may_opt_out(bundled):
    _, on = bundled
    text = "All:\nSpeak, speak. Speak, speak. Speak, speak. Speak, speak."
    out = on.generate([text], SamplingParams(temperature=0, max_tokens=24, speculative=False))[0]
    assert out.speculation is None
    drafted = on.generate([text], SamplingParams(temperature=0, max_tokens=24))[0]
    assert drafted.outputs[0].token_ids == out.outputs[0].token_ids
    assert drafted.speculation is not None and drafted.speculation.num_drafts > 0
    with pytest.raises(ValueError, match="speculative"):
        SamplingParams(speculative="yes")


@pytest.mark.parametrize(
    ("config", "message"),
    [
        ({"method": "eagle"}, "method 'eagle'"),
        ({"num_speculative_tokens": 0}, r"\[1, 16\]"),
        ({"draft_model": "x"}, "unknown keys draft_model"),
        ("{not json", "not valid JSON"),
        ("[1, 2]", "must be a JSON object"),
    ],
)
def test_a_bad_speculative_config_says_what_is_wrong(config, message):
    from weft.engine.factory import speculative_config

    with pytest.raises(ValueError, match=message):
        speculative_config(config)


def test_weft_serve_speculates_and_counts_it_in_vllm_metrics(bundled):
    from test_server import Server

    server = Server("--speculative-config", '{"method": "ngram", "num_speculative_tokens": 3}')
    try:
        # the model's first draft here is accepted (its own loop), before any timing moves the gate
        text = (
            "ROMEO:\nBut soft, what light through yonder window breaks?\n"
            "It is the east, and Juliet is the sun.\n\nROMEO:\nBut soft,"
        )
        reply = server.client().completions.create(
            model="weft-default", prompt=text, max_tokens=24, temperature=0
        )
        expected = bundled[0].generate([text], SamplingParams(temperature=0, max_tokens=24))[0]
        assert reply.choices[0].text == expected.outputs[0].text
        metrics = server.metrics()
        assert metrics["vllm:spec_decode_num_drafts_total"] > 0
        assert metrics["vllm:spec_decode_num_accepted_tokens_total"] > 0
        assert (
            metrics["vllm:spec_decode_num_accepted_tokens_total"]
            <= metrics["vllm:spec_decode_num_draft_tokens_total"]
        )
        again = server.client().completions.create(
            model="weft-default", prompt=text, max_tokens=24, temperature=0, extra_body={"speculative": False}
        )
        assert again.choices[0].text == reply.choices[0].text  # opted out: nothing drafted
        assert (
            server.metrics()["vllm:spec_decode_num_drafts_total"]
            == metrics["vllm:spec_decode_num_drafts_total"]
        )
    finally:
        server.stop()
