"""Lookahead (async scheduling): the next step is scheduled and launched before the step in flight
is read back. Its outputs are the same, token for token, as with each step done in turn."""

from __future__ import annotations

import pytest

from weft import LLM, OutputKind, SamplingParams

PROMPTS = ["First Citizen:", "ROMEO:", "Before we proceed any further, hear me speak.", "All:"]


@pytest.fixture(scope="module")
def pair(tiny_llama) -> tuple[LLM, LLM]:
    """The same engine twice: each step in turn, and with lookahead."""
    options = {"show_progress": False, "device": "cpu", "dtype": "float32", "num_kv_blocks": 64}
    return LLM(str(tiny_llama), async_scheduling=False, **options), LLM(
        str(tiny_llama), async_scheduling=True, **options
    )


def _requests() -> list[tuple[str, SamplingParams]]:
    """Plain rows (greedy and seeded, with stop strings, stop tokens and logprobs) that look
    ahead, mixed with rows that need their tokens first (a grammar, penalties, n > 1's fanout)."""
    plain = [
        SamplingParams(temperature=0, max_tokens=24),
        SamplingParams(temperature=0.9, top_p=0.9, top_k=40, seed=11, max_tokens=30),
        SamplingParams(temperature=1.0, seed=12, max_tokens=20, stop=["e ", "th"], logprobs=3),
        SamplingParams(temperature=0.7, seed=13, max_tokens=17, min_tokens=5, stop_token_ids=[5, 9, 17]),
        SamplingParams(temperature=1.0, seed=14, max_tokens=26, n=3),
    ]
    special = [
        SamplingParams(temperature=0.8, seed=15, max_tokens=16, regex="[a-z]{2,12}( [a-z]{2,12})*"),
        SamplingParams(temperature=0.8, seed=16, max_tokens=16, presence_penalty=0.8, repetition_penalty=1.3),
    ]
    return [(p, params) for i, p in enumerate(PROMPTS) for params in (plain + special)[i::2]]


def _fields(outputs) -> list[tuple]:
    return [
        (
            o.request_id,
            c.index,
            c.token_ids,
            c.text,
            c.finish_reason,
            c.stop_reason,
            c.cumulative_logprob,
            c.logprobs,
        )
        for o in outputs
        for c in o.outputs
    ]


def _run(llm: LLM, requests, abort: dict[str, int] | None = None) -> tuple[list, int]:
    """Every request at once, stepped to the end; `abort`: request id -> the step that aborts it.
    Returns the final outputs and the number of steps that left one in flight."""
    engine = llm.engine
    for _, params in requests:  # compiled (cached) before the first step: its rows start at once
        if params.structured is not None:  # whatever the machine's load, the steps are the same
            engine.grammars.validate(params.structured)
    for i, (prompt, params) in enumerate(requests):
        engine.add_request(f"r{i}", prompt, params.replace(output_kind=OutputKind.FINAL_ONLY))
    finished, looked_ahead, step = [], 0, 0
    while engine.has_unfinished_requests():
        finished += engine.step()
        looked_ahead += engine.in_flight is not None
        step += 1
        for request_id, at in (abort or {}).items():
            if at == step:
                engine.abort_request(request_id)
    assert engine.in_flight is None and engine.kv.num_used_blocks == 0 and not engine.scheduler.running
    return sorted(finished, key=lambda o: o.request_id), looked_ahead


def test_outputs_are_the_same_token_for_token(pair):
    in_turn, ahead = pair
    expected, none = _run(in_turn, _requests())
    got, looked_ahead = _run(ahead, _requests())
    assert none == 0 and looked_ahead > 10  # it did look ahead, most steps
    assert _fields(got) == _fields(expected)
    assert {c.finish_reason for o in got for c in o.outputs} >= {"stop", "length"}


def test_aborted_requests_free_everything_and_the_rest_are_unchanged(pair):
    in_turn, ahead = pair
    requests = _requests()
    abort = {"r0": 3, "r4": 6, "r6": 1}
    expected, _ = _run(in_turn, requests)
    got, looked_ahead = _run(ahead, requests, abort)
    assert looked_ahead > 0
    kept = [f for f in _fields(got) if f[0] not in abort]
    assert kept == [f for f in _fields(expected) if f[0] not in abort]
    assert {o.request_id for o in got} == {f"r{i}" for i in range(len(requests))} - set(abort)


def test_a_stream_never_shows_a_pending_token(pair):
    _, ahead = pair
    params = SamplingParams(temperature=0.9, seed=21, max_tokens=20, output_kind=OutputKind.DELTA)
    pieces = [c.token_ids for out in ahead.generate(["ROMEO:"], params, use_tqdm=False) for c in out.outputs]
    assert pieces and all(token >= 0 for piece in pieces for token in piece)
    whole = ahead.generate(["ROMEO:"], params.replace(output_kind=OutputKind.FINAL_ONLY), use_tqdm=False)
    assert [t for piece in pieces for t in piece] == whole[0].outputs[0].token_ids


def test_beams_and_scores_are_the_same_beside_it(pair):
    """Beam search and scoring run in turn (their policies decide each step); with lookahead on
    they give what they give without it."""
    from weft import BeamSearchParams

    in_turn, ahead = pair
    params = BeamSearchParams(beam_width=3, max_tokens=10)
    expected = in_turn.beam_search(["ROMEO:", "All:"], params)
    got = ahead.beam_search(["ROMEO:", "All:"], params)
    assert [[b.token_ids for b in o.sequences] for o in got] == [
        [b.token_ids for b in o.sequences] for o in expected
    ]
    assert ahead.score("ROMEO:", [" yes", " no"]) == in_turn.score("ROMEO:", [" yes", " no"])


def test_a_sequence_that_ends_for_length_is_not_computed_again(pair, monkeypatch):
    """The host knows when a pending token is a sequence's last (max_tokens): the step after it
    does not compute that row, and a step whose every row ends so is read back at once."""
    in_turn, ahead = pair
    params = SamplingParams(temperature=0.8, seed=3, max_tokens=6, ignore_eos=True)
    rows: list[int] = []
    execute = ahead.engine.runner.execute
    monkeypatch.setattr(
        ahead.engine.runner,
        "execute",
        lambda sched, in_flight=None: rows.append(len(sched.scheduled)) or execute(sched, in_flight),
    )
    got = ahead.generate(["ROMEO:", "All:"], [params, params.replace(max_tokens=3)], use_tqdm=False)
    want = in_turn.generate(["ROMEO:", "All:"], [params, params.replace(max_tokens=3)], use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
    assert rows == [2, 2, 2, 1, 1, 1]  # 6 + 3 rows: one per token, none for a token past the end
    assert ahead.engine.in_flight is None
