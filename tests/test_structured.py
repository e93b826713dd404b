"""Structured generation: outputs always match their constraint; bad constraints fail alone."""

from __future__ import annotations

import enum
import json
import math
import re
from pathlib import Path

import llguidance
import pytest
import torch
from conftest import shared_data
from pydantic import BaseModel, Field

from weft import LLM, SamplingParams
from weft.bench.schema_corpus import load_sample, validation_error
from weft.kernels import TORCH_KERNELS
from weft.structured.bitmask import unpack_bitmask


@pytest.fixture(scope="module")
def llm(tiny_llama) -> LLM:
    return LLM(str(tiny_llama), show_progress=False, max_num_seqs=64)


def completion(llm: LLM, params: SamplingParams, prompt: str = "Output:"):
    return llm.generate(prompt, params, use_tqdm=False)[0].outputs[0]


# ---- JSON Schema corpus --------------------------------------------------------------------


def test_jsonschemabench_sample_is_rejected_or_valid(llm):
    cases = load_sample(shared_data("jsonschema/jsonschemabench"), per_subset=15)
    assert len(cases) >= 300 and len({c.subset for c in cases}) >= 20
    params = [
        SamplingParams(json_schema=c.schema, max_tokens=256, temperature=0.8, seed=i)
        for i, c in enumerate(cases)
    ]
    outputs = llm.generate(["Output:"] * len(cases), params, use_tqdm=False)
    counts = {"stop": 0, "length": 0, "error": 0}
    for case, out in zip(cases, outputs, strict=True):
        result = out.outputs[0]
        counts[result.finish_reason] += 1
        if result.finish_reason == "error":
            assert result.error.startswith("invalid json_schema: ") and result.token_ids == []
        elif result.finish_reason == "stop":
            assert validation_error(case.schema, result.text) is None, (
                case.subset,
                case.case_id,
                result.text,
            )
    assert counts["error"] < 0.3 * len(cases)  # llguidance covers most of the corpus
    assert counts["stop"] > 0.3 * len(cases)  # enough completed outputs to make the check meaningful


# ---- regex, choice, grammars ---------------------------------------------------------------


@pytest.mark.parametrize(
    "pattern",
    [
        r"[0-9]{3}-[a-z]{2,4}",
        r"(yes|no|maybe)!",
        r"[A-Z][a-z]+ [A-Z][a-z]+",
        r"[0-9]+(\.[0-9]{1,2})?",
        r"(ab|cd){2,3}x?",
        r"[a-f0-9]{8}",
    ],
)
def test_regex_outputs_fullmatch(llm, pattern):
    params = [SamplingParams(regex=pattern, temperature=1.0, seed=s, max_tokens=40) for s in range(6)]
    for out in llm.generate(["Output:"] * 6, params, use_tqdm=False):
        result = out.outputs[0]
        if result.finish_reason == "stop":
            assert re.fullmatch(pattern, result.text), result.text
        else:
            assert result.finish_reason == "length"


def test_choices_return_one_option_exactly(llm):
    options = ["Romeo", "Juliet", "Mercutio the brave", "Tybalt"]
    params = [SamplingParams(choice=options, temperature=1.0, seed=s) for s in range(12)]
    results = [o.outputs[0] for o in llm.generate(["Who?"] * 12, params, use_tqdm=False)]
    assert all(r.text in options and r.finish_reason == "stop" for r in results)
    assert len({r.text for r in results}) > 1


def accepts(llm: LLM, grammar: str, syntax: str, text: str) -> bool:
    """Check `text` against the grammar with a fresh matcher over its re-tokenization."""
    backend = llm.engine.grammars.backend
    spec = SamplingParams(grammar=grammar, grammar_syntax=syntax).structured
    matcher = backend.compile(spec).template.deep_copy()
    tokens = backend.tokenizer.tokenize_str(text)
    return matcher.consume_tokens(tokens) and matcher.is_accepting()


GRAMMARS = [
    "gbnf/arithmetic.gbnf",
    "gbnf/list.gbnf",
    "gbnf/chess.gbnf",
    "gbnf/json.gbnf",
    "gbnf/json_arr.gbnf",
    "lark/outlines_arithmetic.lark",
    "lark/outlines_json.lark",
]


@pytest.mark.parametrize("name", GRAMMARS)
def test_grammar_outputs_are_accepted(llm, name):
    path = shared_data(f"grammars/{name}")
    grammar, syntax = path.read_text(), "gbnf" if name.endswith(".gbnf") else "lark"
    params = [
        SamplingParams(grammar=grammar, grammar_syntax=syntax, temperature=0.9, seed=s, max_tokens=80)
        for s in range(8)
    ]
    results = [o.outputs[0] for o in llm.generate(["Output:"] * 8, params, use_tqdm=False)]
    assert all(r.finish_reason in ("stop", "length") for r in results), [r.error for r in results]
    finished = [r.text for r in results if r.finish_reason == "stop"]
    for text in finished:
        assert accepts(llm, grammar, syntax, text), text
        if name.startswith("gbnf/json"):  # (outlines_json.lark allows "+1", which JSON does not)
            json.loads(text)
        if name.endswith(".lark"):
            _lark_parse(path, text)


def _lark_parse(path: Path, text: str) -> None:
    """An independent parser: the `lark` package on the same grammar file."""
    import lark

    lark.Lark(path.read_text(), start="start", parser="earley").parse(text)


def test_gbnf_is_detected_or_selected():
    assert SamplingParams(grammar='root ::= "a"').structured.kind.value == "gbnf"
    assert SamplingParams(grammar='start: "a"').structured.kind.value == "lark"
    assert SamplingParams(grammar='start: "a"', grammar_syntax="gbnf").structured.kind.value == "gbnf"


# ---- the step ------------------------------------------------------------------------------


def test_mixed_batch_matches_each_request_alone(llm):
    params = [
        SamplingParams(
            json_schema={"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]},
            temperature=0.9,
            seed=1,
            max_tokens=30,
        ),
        SamplingParams(temperature=0.9, seed=2, max_tokens=20),
        SamplingParams(regex=r"[a-z]{3,8}", temperature=1.0, seed=3),
        SamplingParams(temperature=0, max_tokens=15),
        SamplingParams(choice=["alpha", "beta", "gamma"], seed=5),
    ]
    prompts = ["Output:", "First", "Word:", "You", "Pick:"]
    together = llm.generate(prompts, params, use_tqdm=False)
    for prompt, p, out in zip(prompts, params, together, strict=True):
        alone = llm.generate(prompt, p, use_tqdm=False)[0]
        assert out.outputs[0].token_ids == alone.outputs[0].token_ids


def test_fast_forward_gives_same_greedy_output_in_fewer_steps(llm):
    schema = {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 8},
            "count": {"type": "integer", "minimum": 0, "maximum": 999},
            "kind": {"enum": ["first", "second"]},
        },
        "required": ["name", "count", "kind"],
        "additionalProperties": False,
    }
    results = {}
    for ff in (True, False):
        before = llm.stats()["num_sampled_tokens"]
        out = completion(
            llm, SamplingParams(json_schema=schema, temperature=0, max_tokens=80, fast_forward=ff)
        )
        results[ff] = (out.text, out.token_ids, llm.stats()["num_sampled_tokens"] - before)
    assert results[True][:2] == results[False][:2]
    assert results[True][2] < results[False][2]
    assert validation_error(schema, results[True][0]) is None


def test_max_tokens_before_grammar_completes_is_length(llm):
    out = completion(llm, SamplingParams(regex=r"[a-z]{50}", max_tokens=5, temperature=0))
    assert out.finish_reason == "length" and len(out.token_ids) == 5


def test_logits_processor_runs_after_the_mask(llm):
    seen_allowed: list[int] = []

    def record(token_ids, logits):
        seen_allowed.append(int(torch.isfinite(logits).sum()))
        return logits

    out = completion(llm, SamplingParams(choice=["yes", "no"], logits_processors=[record], temperature=0))
    assert out.text in ("yes", "no")
    assert seen_allowed and max(seen_allowed) < 10  # the processor saw the masked row


def test_n_samples_each_match_the_grammar(llm):
    (out,) = llm.generate(
        "Output:", SamplingParams(n=4, regex=r"[0-9]{2,5}", temperature=1.0, seed=9), use_tqdm=False
    )
    assert len(out.outputs) == 4
    assert all(re.fullmatch(r"[0-9]{2,5}", c.text) for c in out.outputs if c.finish_reason == "stop")


# ---- errors --------------------------------------------------------------------------------


def test_bad_schema_fails_alone_in_a_batch(llm):
    params = [
        SamplingParams(temperature=0, max_tokens=8),
        SamplingParams(json_schema={"type": "no-such-type"}),
        SamplingParams(regex=r"(unclosed", max_tokens=8),
        SamplingParams(regex=r"[a-z]+", max_tokens=8),
    ]
    outputs = llm.generate(["First"] * 4, params, use_tqdm=False)
    assert outputs[1].outputs[0].finish_reason == "error"
    assert (
        "invalid json_schema" in outputs[1].outputs[0].error and "no-such-type" in outputs[1].outputs[0].error
    )
    assert outputs[2].outputs[0].finish_reason == "error" and "invalid regex" in outputs[2].outputs[0].error
    assert outputs[0].outputs[0].finish_reason == "length" and len(outputs[0].outputs[0].token_ids) == 8
    assert outputs[3].outputs[0].finish_reason in ("stop", "length") and outputs[3].outputs[0].text


def test_constraint_errors_at_construction():
    with pytest.raises(ValueError, match="at most one output constraint, got json_schema, regex"):
        SamplingParams(json_schema={"type": "object"}, regex="a")
    with pytest.raises(ValueError, match="json_schema is not valid JSON"):
        SamplingParams(json_schema="{not json")
    with pytest.raises(ValueError, match="choice"):
        SamplingParams(choice=[])


# ---- Pydantic ------------------------------------------------------------------------------


class Color(enum.Enum):
    RED = "red"
    GREEN = "green"


class Address(BaseModel):
    city: str = Field(max_length=12)
    zip_code: int = Field(ge=10000, le=99999)


class Person(BaseModel):
    name: str = Field(max_length=12)
    color: Color
    nickname: str | None = Field(default=None, max_length=8)
    address: Address
    scores: list[int] = Field(max_length=3)


def test_pydantic_round_trip(llm):
    params = [SamplingParams(json_schema=Person, temperature=0.7, seed=s, max_tokens=300) for s in range(8)]
    results = [o.outputs[0] for o in llm.generate(["Person:"] * 8, params, use_tqdm=False)]
    finished = [r for r in results if r.finish_reason == "stop"]
    assert finished
    for r in finished:
        person = Person.model_validate_json(r.text)
        assert isinstance(person.address, Address) and isinstance(person.color, Color)


# ---- bitmask -------------------------------------------------------------------------------


def test_bitmask_matches_reference():
    gen = torch.Generator().manual_seed(0)
    vocab = 1000
    bitmask = torch.randint(-(2**31), 2**31 - 1, (3, (vocab + 31) // 32), generator=gen, dtype=torch.int64)
    bitmask = bitmask.to(torch.int32)
    expected = torch.tensor(
        [[(int(bitmask[r, t // 32]) >> (t % 32)) & 1 for t in range(vocab)] for r in range(3)]
    )
    assert torch.equal(unpack_bitmask(bitmask, vocab), expected.bool())
    logits = torch.randn(5, vocab, generator=gen)
    original = logits.clone()
    rows = torch.tensor([4, 0, 2])
    TORCH_KERNELS.apply_token_bitmask_(logits, bitmask, rows)
    for k, row in enumerate(rows.tolist()):
        want = original[row].masked_fill(~expected[k].bool(), float("-inf"))
        assert torch.equal(logits[row], want)
    assert torch.equal(logits[[1, 3]], original[[1, 3]])  # unconstrained rows untouched


def test_bitmask_agrees_with_llguidance_torch():
    tokenizer = llguidance.LLTokenizer("byte")
    matcher = llguidance.LLMatcher(tokenizer, llguidance.grammar_from("regex", "[a-c]+"))
    import llguidance.torch as lt

    bitmask = lt.allocate_token_bitmask(1, tokenizer.vocab_size)
    lt.fill_next_token_bitmask(matcher, bitmask)
    allowed = unpack_bitmask(bitmask, tokenizer.vocab_size)[0]
    assert set(torch.nonzero(allowed).flatten().tolist()) == {tokenizer.tokenize_str(c)[0] for c in "abc"}


# ---- the benchmark's accounting -------------------------------------------------------------


def test_structured_bench_counts_the_tokens_each_timed_step_computes(llm):
    """`weft bench structured` times full-batch steps against the tokens they compute: one per row
    per step without forcing; with fast-forward, forced tokens count in the step that computes them."""
    from weft.bench.structured import time_weft

    schema = {
        "type": "object",
        "properties": {"name": {"type": "string", "maxLength": 6}, "id": {"type": "integer"}},
        "required": ["name", "id"],
        "additionalProperties": False,
    }
    prompt = llm.tokenizer.encode("Output:")
    free = time_weft(llm, [prompt] * 3, None, 12)
    assert free.num_tokens == 3 * 11 and free.num_forced == 0  # the 12th token came from the prefill step
    assert free.all_seconds >= free.seconds > 0
    ff = time_weft(llm, [prompt] * 3, [schema] * 3, 40, fast_forward=True)
    assert ff.num_forced > 0 and 0 < ff.num_tokens <= ff.num_total
    assert ff.whole_run_tokens_per_s > 0


def test_constraint_logmass_is_the_model_mass_the_grammar_allowed(tiny_llama):
    """With logprobs, each position reports log(sum of the model's probabilities of the tokens the
    grammar allowed); checked at the first position against a fresh matcher's own mask."""
    llm = LLM(str(tiny_llama), show_progress=False, device="cpu", dtype="float32", max_logprobs=1000)
    vocab = llm.config.model.vocab_size
    regex = "[a-z]{2,6}[0-9]"
    params = SamplingParams(regex=regex, logprobs=vocab, temperature=0, max_tokens=8)
    out = llm.generate("Output:", params, use_tqdm=False)[0].outputs[0]
    assert out.constraint_logmass is not None and len(out.constraint_logmass) == len(out.token_ids)
    backend = llm.engine.grammars.backend
    matcher = backend.new_matcher(backend.compile(params.structured))
    bitmask = torch.zeros(1, (vocab + 31) // 32, dtype=torch.int32)
    backend.fill_bitmask([(matcher, 0, ())], bitmask)
    allowed = unpack_bitmask(bitmask, vocab)[0]
    first = out.logprobs[0]
    raw = torch.tensor([first[t].logprob if t in first else float("-inf") for t in range(vocab)])
    expected = torch.logsumexp(raw[allowed], dim=0).item()
    assert out.constraint_logmass[0] == pytest.approx(expected, abs=1e-4)
    for mass, token, position in zip(out.constraint_logmass, out.token_ids, out.logprobs, strict=True):
        assert position[token].logprob - 1e-5 <= mass <= 1e-6
    plain = llm.generate("Output:", SamplingParams(logprobs=1, max_tokens=4), use_tqdm=False)[0].outputs[0]
    assert plain.constraint_logmass == [0.0] * len(plain.token_ids)


def test_processed_logprobs_under_a_grammar_are_consistent(tiny_llama):
    """In processed mode the distribution is the masked one: the allowed tokens' probabilities sum
    to at most 1, disallowed ones are -inf, and the sampled token is present with its exact rank."""
    llm = LLM(str(tiny_llama), show_progress=False, device="cpu", dtype="float32", max_logprobs=1000)
    vocab = llm.config.model.vocab_size
    params = SamplingParams(
        regex="[a-z]{3,8}", logprobs=vocab, logprobs_mode="processed", temperature=0.9, seed=2, max_tokens=6
    )
    out = llm.generate("Output:", params, use_tqdm=False)[0].outputs[0]
    assert out.logprobs
    for token, position in zip(out.token_ids, out.logprobs, strict=True):
        probabilities = [math.exp(lp.logprob) for lp in position.values()]
        assert sum(probabilities) <= 1 + 1e-4
        assert any(lp.logprob == float("-inf") for lp in position.values())  # the mask is visible
        chosen = position[token]
        assert chosen.logprob > float("-inf")
        assert chosen.rank == 1 + sum(lp.logprob > chosen.logprob for lp in position.values())
