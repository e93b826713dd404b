"""`Sequence`: append() and fork() at any depth, with a grammar, fast-forward and stop strings; no
model involved (tokens are drawn from what the grammar allows)."""

from __future__ import annotations

import itertools
import random
from collections.abc import Sequence as Seq

import numpy as np
import pytest
import torch

from weft.engine.default_model import bundled_model_path
from weft.engine.sequence import FinishReason, Sequence, SequenceLimits
from weft.logprob_records import Logprob, LogprobRef, position_logprobs, row_refs
from weft.params import OutputKind, SamplingParams
from weft.structured.bitmask import bitmask_words, unpack_bitmask
from weft.structured.llguidance_backend import LLGuidanceBackend, LLGuidanceMatcher
from weft.tokenizer import Tokenizer

TOKENIZER = Tokenizer.from_dir(bundled_model_path())
VOCAB = TOKENIZER.vocab_size
EOS = TOKENIZER.eos_token_id
LIMITS = SequenceLimits(max_model_len=512, eos_token_ids=frozenset({EOS}))
_ids = itertools.count()


class CountingMatcher:
    """Wraps a matcher and counts every token it consumes: a replayed prefix would show up here."""

    def __init__(self, inner: LLGuidanceMatcher) -> None:
        self.inner = inner
        self.num_consumed = 0

    @property
    def error(self) -> str | None:
        return self.inner.error

    @property
    def is_finished(self) -> bool:
        return self.inner.is_finished

    def consume(self, token_ids: Seq[int]) -> bool:
        self.num_consumed += len(token_ids)
        return self.inner.consume(token_ids)

    def rollback(self, num_tokens: int) -> None:
        self.inner.rollback(num_tokens)

    def validate(self, token_ids: Seq[int]) -> int:
        return self.inner.validate(token_ids)

    def forced_tokens(self) -> list[int]:
        return self.inner.forced_tokens()

    def fork(self) -> CountingMatcher:
        return CountingMatcher(self.inner.fork())


@pytest.fixture(scope="module")
def backend() -> LLGuidanceBackend:
    return LLGuidanceBackend(TOKENIZER.tokenizer.to_str(), VOCAB, [EOS])


def new_sequence(params: SamplingParams, backend: LLGuidanceBackend | None) -> Sequence:
    prompt = TOKENIZER.encode("Output:")
    seq = Sequence.create(next(_ids), params, prompt, LIMITS, seed=1, tokenizer=TOKENIZER)
    if backend is not None and params.structured is not None:
        seq.matcher = CountingMatcher(backend.new_matcher(backend.compile(params.structured)))
    return seq


def allowed_tokens(seq: Sequence, backend: LLGuidanceBackend) -> list[int]:
    bitmask = torch.zeros(1, bitmask_words(VOCAB), dtype=torch.int32)
    assert isinstance(seq.matcher, CountingMatcher)
    backend.fill_bitmask([(seq.matcher.inner, 0, ())], bitmask)
    return torch.nonzero(unpack_bitmask(bitmask, VOCAB)[0]).flatten().tolist()


def next_token(seq: Sequence, backend: LLGuidanceBackend | None, rng: random.Random) -> int:
    if seq.matcher is None or backend is None:
        return rng.randrange(3, VOCAB)
    allowed = allowed_tokens(seq, backend)
    not_eos = [t for t in allowed if t != EOS]
    return rng.choice(not_eos or allowed)


SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "maxItems": 3},
        "count": {"type": "integer"},
    },
    "required": ["name", "tags", "count"],
}

CASES = {
    # open objects: room for 12 random steps before the document ends (closed, it ends sooner)
    "json_schema": SamplingParams(json_schema=SCHEMA, max_tokens=80, json_schema_mode="open"),
    "json_schema_no_ff": SamplingParams(json_schema=SCHEMA, max_tokens=80, fast_forward=False),
    "regex": SamplingParams(regex=r"([a-z]{2,5} ){3,8}[0-9]{4}", max_tokens=60),
    "stop_strings": SamplingParams(max_tokens=60, stop=["e t", "xq"], include_stop_str_in_output=True),
}


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("depth", [0, 1, 5, 12])
def test_fork_continues_exactly_as_the_parent(backend, case, depth):
    params = CASES[case]
    rng = random.Random(depth)
    parent = new_sequence(params, backend)
    for _ in range(depth):
        if parent.is_finished:
            break
        parent.append(next_token(parent, backend, rng))
    if parent.is_finished:
        pytest.skip("the parent finished before the fork depth")
    child = parent.fork(next(_ids), index=1, seed=2)
    assert child.token_ids == parent.token_ids and child.text == parent.text
    while not parent.is_finished:
        if parent.matcher is not None:
            assert allowed_tokens(child, backend) == allowed_tokens(parent, backend)
        token = next_token(parent, backend, rng)
        assert parent.append(token) == child.append(token)
        assert child.token_ids == parent.token_ids and child.text == parent.text
    assert child.is_finished
    a, b = parent.completion(OutputKind.CUMULATIVE), child.completion(OutputKind.CUMULATIVE)
    assert (a.text, a.token_ids, a.finish_reason, a.stop_reason) == (
        b.text,
        b.token_ids,
        b.finish_reason,
        b.stop_reason,
    )
    assert b.index == 1


@pytest.mark.parametrize("depth", [0, 3, 9])
def test_fork_never_replays_the_matcher(backend, depth):
    rng = random.Random(7)
    parent = new_sequence(CASES["json_schema"], backend)
    for _ in range(depth):
        parent.append(next_token(parent, backend, rng))
    assert isinstance(parent.matcher, CountingMatcher)
    parent_consumed = parent.matcher.num_consumed
    child = parent.fork(next(_ids), index=1, seed=2)
    assert isinstance(child.matcher, CountingMatcher) and child.matcher.num_consumed == 0
    num_output_before = child.num_output_tokens
    for _ in range(4):
        if child.is_finished:
            break
        child.append(next_token(child, backend, rng))
    # The child's matcher consumed exactly the tokens appended to the child (sampled and forced),
    # none of the prefix it inherited; the parent's matcher was not touched by the child.
    consumed = child.matcher.num_consumed if child.matcher else None
    if consumed is not None:
        assert consumed == child.num_output_tokens - num_output_before
    assert parent.matcher.num_consumed == parent_consumed


def test_rejected_token_fails_the_sequence_and_is_dropped(backend):
    seq = new_sequence(SamplingParams(regex="[0-9]+", max_tokens=10), backend)
    letter = TOKENIZER.encode("a", add_special_tokens=False)[0]
    assert seq.append(letter) == 0
    assert seq.finish_reason == FinishReason.ERROR and seq.output_token_ids == [] and seq.matcher is None


def test_fast_forward_appends_forced_tokens(backend):
    seq = new_sequence(SamplingParams(regex="abc-[0-9]", max_tokens=10), backend)
    first = TOKENIZER.encode("a", add_special_tokens=False)[0]
    assert seq.append(first) > 1  # "bc-" is forced
    assert seq.text.startswith("abc-")


def test_fork_of_a_plain_sequence_copies_text_and_logprobs():
    params = SamplingParams(max_tokens=20, logprobs=1)
    seq = new_sequence(params, None)
    for token in (40, 41, 42):
        seq.append(token, LogprobRef.of([token, 7], [-1.0, -0.5], 2))
    child = seq.fork(next(_ids), index=3, seed=9)
    child.append(43, LogprobRef.of([43, 7], [-2.0, -0.1], 3))
    assert seq.position_outputs is not None and child.position_outputs is not None
    assert len(seq.position_outputs.records) == 3 and len(child.position_outputs.records) == 4
    assert seq.cumulative_logprob == pytest.approx(-3.0) and child.cumulative_logprob == pytest.approx(-5.0)
    assert child.index == 3 and child.seed == 9 and child.outcome is None


def test_a_position_record_puts_the_chosen_token_first_with_its_own_rank():
    texts = {t: f"<{t}>" for t in range(10)}
    # The chosen token (3, rank 2) is also the second alternative: it keeps its own record, first.
    position = position_logprobs([3, 5, 3, 7], [-0.9, -0.5, -0.9, -2.0], 2, 3, texts)
    assert list(position) == [3, 5, 7]
    assert position[3] == Logprob(-0.9, 2, "<3>")
    assert position[5] == Logprob(-0.5, 1, "<5>") and position[7] == Logprob(-2.0, 3, "<7>")
    # Not among them: every alternative after it, ranked 1..n; n caps what is reported.
    position = position_logprobs([8, 5, 3, 7], [-4.0, -0.5, -0.9, -2.0], 9, 2, texts)
    assert list(position.items()) == [
        (8, Logprob(-4.0, 9, "<8>")),
        (5, Logprob(-0.5, 1, "<5>")),
        (3, Logprob(-0.9, 2, "<3>")),
    ]
    assert position_logprobs([8, 5], [-4.0, -0.5], 9, 0, texts) == {8: Logprob(-4.0, 9, "<8>")}


def test_logprob_records_are_built_from_the_step_block_when_an_output_is_read():
    """Each position keeps a reference to its row of the step's host block; the dicts are built
    the first time `CompletionOutput.logprobs` is read, and a DELTA output holds only its span."""
    params = SamplingParams(max_tokens=20, logprobs=1, output_kind=OutputKind.DELTA)
    seq = new_sequence(params, None)
    texts = TOKENIZER.token_texts
    blocks = []
    for step, token in enumerate((40, 41, 42)):
        # two rows of (rank, extra, ids [2], logprobs [2]); this sequence samples row 1
        block = np.array([[1, 0.0, 5, 6, -0.1, -0.2], [2, -0.5, token, 7, -1.0 - step, -0.5]], np.float64)
        blocks.append(block)
        ref = row_refs(block)[1]
        assert (ref.row, ref.logprob, ref.extra) == (1, -1.0 - step, -0.5)
        seq.append(token, ref)
        if step == 0:
            first = seq.completion(OutputKind.DELTA)
    rest = seq.completion(OutputKind.DELTA)
    assert first.logprobs == [{40: Logprob(-1.0, 2, texts[40]), 7: Logprob(-0.5, 1, texts[7])}]
    assert [list(p) for p in rest.logprobs or []] == [[41, 7], [42, 7]]
    assert seq.cumulative_logprob == pytest.approx(-6.0)
    whole = seq.completion(OutputKind.CUMULATIVE)
    seq.append(43, LogprobRef.of([43, 7], [-2.0, -0.1], 3))
    assert len(whole.logprobs or []) == 3  # a snapshot: later positions are not in it


def test_position_outputs_roll_back_to_what_they_were_before_the_tokens():
    """Rolling back k output tokens leaves the records, flags, offsets and the cumulative sum exactly
    as they were before those tokens were appended (speculation drops unconfirmed tokens)."""
    seq = new_sequence(SamplingParams(max_tokens=20, logprobs=1), None)
    for token, value in ((40, -1.25), (41, -0.5)):
        seq.append(token, LogprobRef.of([token, 7], [value, -0.1], 2))
    positions = seq.position_outputs
    assert positions is not None
    before = positions.fork()
    for token, value in ((42, -3.0), (43, -0.3)):
        seq.append(token, LogprobRef.of([token, 7], [value, -0.1], 2))
    positions.text_offsets.append(len(seq.text))  # a forced token still without its logprobs
    positions.rollback(3)
    assert positions.records == before.records and positions.forced == before.forced
    assert positions.text_offsets == before.text_offsets
    assert positions.constraint_logmass == before.constraint_logmass
    assert positions.cumulative_logprob == before.cumulative_logprob == -1.75
    logprobs, logmass, offsets, forced = positions.span(1, 2, 1, TOKENIZER.token_texts)
    assert [list(p) for p in logprobs.build()] == [[41, 7]] and logmass == [0.0] and offsets == [1]
    assert forced == [False]
