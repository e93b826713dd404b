"""Logprobs of tokens a grammar forces. With fast-forward on, a request that wants logprobs still
appends forced tokens without sampling them; the next step computes them like prompt tokens and
gives them the model's own logprobs there, flagged in `CompletionOutput.forced`. Checked against
transformers on the same sequence, and for finishes, limits, streams, chunks and preemption."""

from __future__ import annotations

import pytest
import torch
import transformers

from weft import LLM, SamplingParams
from weft.params import OutputKind

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "count": {"type": "integer", "minimum": 0, "maximum": 999},
        "kind": {"enum": ["first", "second"]},
    },
    "required": ["name", "count", "kind"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def llm(tiny_llama) -> LLM:
    return LLM(str(tiny_llama), show_progress=False, device="cpu", dtype="float32", max_num_seqs=16)


@pytest.fixture(scope="module")
def reference(tiny_llama):
    return transformers.AutoModelForCausalLM.from_pretrained(tiny_llama).eval()


def generate(llm: LLM, params: SamplingParams, prompt: str = "Output:"):
    return llm.generate(prompt, params, use_tqdm=False)[0]


def chosen(token_ids: list[int], logprobs) -> list[float]:
    return [position[token].logprob for token, position in zip(token_ids, logprobs, strict=True)]


def check_against_reference(reference, prompt_ids: list[int], completion, k: int) -> None:
    """Every position's chosen logprob, rank and top-k equal transformers' log-softmax of its
    logits at the position before it (rank = 1 + the number of strictly more likely tokens)."""
    ids = prompt_ids + completion.token_ids
    with torch.no_grad():
        logprobs = torch.log_softmax(reference(torch.tensor([ids])).logits[0].float(), dim=-1)  # [L, V]
    for i, (token, position) in enumerate(zip(completion.token_ids, completion.logprobs, strict=True)):
        row = logprobs[len(prompt_ids) + i - 1]
        assert position[token].logprob == pytest.approx(float(row[token]), abs=1e-4), i
        assert position[token].rank == int((row > row[token]).sum()) + 1, i
        top = torch.sort(row, descending=True, stable=True).indices[:k].tolist()
        assert set(top) <= set(position), i


def test_forced_tokens_get_the_models_logprobs(llm, reference):
    params = SamplingParams(json_schema=SCHEMA, temperature=0, max_tokens=80, logprobs=3)
    forced_before = llm.stats()["num_forced_tokens"]
    out = generate(llm, params)
    c = out.outputs[0]
    assert c.finish_reason == "stop" and c.forced is not None
    assert any(c.forced) and not all(c.forced)
    assert llm.stats()["num_forced_tokens"] - forced_before == sum(c.forced)  # fast-forward stayed on
    n = len(c.token_ids)
    assert len(c.logprobs) == len(c.forced) == len(c.constraint_logmass) == len(c.text_offsets) == n
    check_against_reference(reference, out.prompt_token_ids, c, 3)
    for token, position, forced, logmass in zip(
        c.token_ids, c.logprobs, c.forced, c.constraint_logmass, strict=True
    ):
        if forced:  # the only token fast-forward allowed: the allowed mass is its own probability
            assert logmass == pytest.approx(position[token].logprob)
    assert c.cumulative_logprob == pytest.approx(sum(chosen(c.token_ids, c.logprobs)))
    plain = generate(llm, SamplingParams(json_schema=SCHEMA, temperature=0, max_tokens=80))
    assert plain.outputs[0].token_ids == c.token_ids and plain.outputs[0].text == c.text


def test_a_grammar_that_ends_on_forced_tokens_finishes_after_computing_them(llm, reference):
    """After the sampled word the rest is forced and the grammar is complete: the sequence computes
    the forced tokens (sampling nothing) before it finishes, so every token has its logprob."""
    params = SamplingParams(
        regex="(alpha|omega) and the rest is forced", temperature=0, logprobs=2, max_tokens=100
    )
    out = generate(llm, params)
    c = out.outputs[0]
    assert c.finish_reason == "stop" and c.text.endswith(" and the rest is forced")
    assert c.forced[-1] and len(c.logprobs) == len(c.token_ids)
    check_against_reference(reference, out.prompt_token_ids, c, 2)


def test_max_tokens_inside_the_forced_tokens(llm, reference):
    params = SamplingParams(regex="a fixed tail of several tokens", temperature=0, logprobs=1, max_tokens=3)
    out = generate(llm, params)
    c = out.outputs[0]
    assert c.finish_reason == "length" and len(c.token_ids) == len(c.logprobs) == 3
    assert c.forced[1:] == [True, True]
    check_against_reference(reference, out.prompt_token_ids, c, 1)


def test_stream_holds_forced_tokens_back_until_their_logprobs_arrive(llm):
    params = SamplingParams(json_schema=SCHEMA, temperature=0, max_tokens=80, logprobs=2)
    whole = generate(llm, params).outputs[0]
    engine = llm.engine
    engine.add_request("stream", "Output:", params.replace(output_kind=OutputKind.DELTA))
    text, token_ids, logprobs, forced = "", [], [], []
    while engine.has_unfinished_requests():
        for out in engine.step():
            delta = out.outputs[0]
            assert len(delta.token_ids) == len(delta.logprobs) == len(delta.forced)  # aligned in each delta
            text += delta.text
            token_ids += delta.token_ids
            logprobs += delta.logprobs
            forced += delta.forced
    assert (text, token_ids, forced) == (whole.text, whole.token_ids, whole.forced)
    assert chosen(token_ids, logprobs) == pytest.approx(chosen(whole.token_ids, whole.logprobs), abs=1e-5)


def test_mixed_batch_chunks_and_preemption_give_the_same_logprobs(tiny_llama, llm):
    """Requests with and without logprobs in one batch, a 4-token budget (forced tokens computed in
    chunks) and a pool small enough to preempt: the same tokens and logprobs as one request alone."""
    with_logprobs = SamplingParams(json_schema=SCHEMA, temperature=0, max_tokens=60, logprobs=1)
    alone = generate(llm, with_logprobs).outputs[0]
    small = LLM(
        str(tiny_llama),
        show_progress=False,
        device="cpu",
        dtype="float32",
        max_num_batched_tokens=4,
        block_size=4,
        num_kv_blocks=20,
        max_model_len=80,
    )
    prompts = ["Output:", "Output:", "Another prompt, a longer one:", "Output:"]
    params = [
        with_logprobs,
        SamplingParams(json_schema=SCHEMA, temperature=0, max_tokens=60),
        SamplingParams(max_tokens=40, temperature=0, ignore_eos=True),
        with_logprobs.replace(temperature=0.8, seed=5),
    ]
    outputs = small.generate(prompts, params, use_tqdm=False)
    assert small.stats()["num_preemptions"] > 0
    first, second = outputs[0].outputs[0], outputs[1].outputs[0]
    assert first.token_ids == second.token_ids == alone.token_ids and first.forced == alone.forced
    assert chosen(first.token_ids, first.logprobs) == pytest.approx(
        chosen(alone.token_ids, alone.logprobs), abs=1e-4
    )
    sampled = outputs[3].outputs[0]
    assert len(sampled.logprobs) == len(sampled.token_ids) == len(sampled.forced)
    assert small.stats()["kv_blocks_used"] == 0
