"""A randomized soak on the bundled model: requests with mixed parameters arrive in waves into a KV
pool small enough to force preemption, some are aborted at random steps. Afterwards none is lost,
every constrained output is valid, every seeded or greedy request equals its solo run, and no KV
block is in use. `pytest -m soak` runs a longer variant."""

from __future__ import annotations

import json
import random
import re
from dataclasses import dataclass

import jsonschema
import pytest

from weft import LLM, SamplingParams, bundled_model_path

SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 8}, "age": {"type": "integer"}},
    "required": ["name", "age"],
}
REGEX = r"[A-Z][a-z]{1,6} [0-9]{2}"
CHOICES = ["ROMEO", "JULIET", "MERCUTIO", "TYBALT"]
PROMPTS = ["ROMEO:", "JULIET:\nO", "First Citizen:\nBefore we proceed", "KING HENRY:", "Nurse:", "What, "]


@dataclass
class Case:
    request_id: str
    prompt: str
    params: SamplingParams
    kind: str


def random_case(rng: random.Random, index: int) -> Case:
    kind = rng.choice(["greedy", "seeded", "unseeded", "json", "regex", "choice", "logprobs", "n", "stop"])
    base = {"max_tokens": rng.randint(3, 24), "temperature": 0.9, "seed": rng.randrange(10**6)}
    extra = {
        "greedy": {"temperature": 0},
        "seeded": {"top_p": 0.9, "repetition_penalty": 1.1},
        "unseeded": {"seed": None},
        "json": {"json_schema": SCHEMA, "max_tokens": 40},
        "regex": {"regex": REGEX},
        "choice": {"choice": CHOICES},
        "logprobs": {"logprobs": 3},
        "n": {"n": rng.randint(2, 3)},
        "stop": {"stop": ["\n", "e"], "min_tokens": 1},
    }[kind]
    return Case(f"soak-{index}", rng.choice(PROMPTS), SamplingParams(**{**base, **extra}), kind)


def run_waves(llm: LLM, cases: list[Case], num_aborts: int, rng: random.Random) -> dict[str, object]:
    """Add the cases in waves while stepping; abort `num_aborts` running ones at random steps."""
    engine, pending, finished = llm.engine, list(cases), {}
    added: list[str] = []
    aborted: set[str] = set()
    while pending or engine.has_unfinished_requests():
        num_new = rng.randint(0, 12)
        for case in pending[:num_new]:
            engine.add_request(case.request_id, case.prompt, case.params)
            added.append(case.request_id)
        pending = pending[num_new:]
        if engine.has_unfinished_requests():
            finished.update({o.request_id: o for o in engine.step() if o.finished})
        live = [r for r in added if r not in finished and r not in aborted]
        if live and len(aborted) < num_aborts and rng.random() < 0.08:
            victim = rng.choice(live)
            engine.abort_request(victim)
            aborted.add(victim)
    return {"finished": finished, "aborted": aborted}


def check_output(case: Case, output) -> None:
    for completion in output.outputs:
        assert completion.finish_reason in ("stop", "length"), (case.kind, completion.error)
        if completion.finish_reason != "stop":
            continue
        if case.kind == "json":
            jsonschema.validate(json.loads(completion.text), SCHEMA)
        elif case.kind == "regex":
            assert re.fullmatch(REGEX, completion.text), completion.text
        elif case.kind == "choice":
            assert completion.text in CHOICES


def soak(num_requests: int, num_aborts: int, seed: int) -> None:
    rng = random.Random(seed)
    llm = LLM(
        bundled_model_path(),
        show_progress=False,
        num_kv_blocks=40,
        block_size=8,
        max_model_len=128,
        max_num_seqs=24,
    )
    cases = [random_case(rng, i) for i in range(num_requests)]
    result = run_waves(llm, cases, num_aborts, rng)
    finished, aborted = result["finished"], result["aborted"]
    assert isinstance(finished, dict) and isinstance(aborted, set)
    assert set(finished) | aborted == {c.request_id for c in cases}, "a request was lost"
    assert llm.stats()["num_preemptions"] > 0, "the pool was meant to force preemption"
    stats = llm.stats()
    assert stats["kv_blocks_used"] == 0 and stats["num_running"] == 0 and stats["num_waiting"] == 0
    deterministic = [c for c in cases if c.request_id in finished and c.kind != "unseeded"]
    for case in cases:
        if case.request_id in finished:
            check_output(case, finished[case.request_id])
    solo_llm = LLM(bundled_model_path(), show_progress=False, max_model_len=128)
    for case in deterministic:
        (alone,) = solo_llm.generate(case.prompt, case.params, use_tqdm=False)
        together = finished[case.request_id]
        assert [c.token_ids for c in together.outputs] == [c.token_ids for c in alone.outputs], case.kind


def test_soak_mixed_requests_in_waves():
    soak(num_requests=200, num_aborts=10, seed=0)


@pytest.mark.soak
@pytest.mark.parametrize("seed", [1, 2, 3])
def test_soak_long(seed):
    soak(num_requests=1500, num_aborts=60, seed=seed)
