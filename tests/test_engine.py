"""The engine end to end on a tiny random checkpoint: batching, seeds, n > 1, stop rules,
streaming, preemption, errors."""

from __future__ import annotations

import re

import pytest
import torch

from weft import LLM, SamplingParams

PROMPTS = ["First Citizen:", "You are all resolved", "We know't", "Speak, speak."]


@pytest.fixture(scope="module")
def llm(tiny_llama) -> LLM:
    return LLM(str(tiny_llama), show_progress=False)


def texts(outputs) -> list[str]:
    return [o.outputs[0].text for o in outputs]


def test_seeded_output_is_independent_of_batch(llm):
    params = SamplingParams(temperature=1.0, top_p=0.9, seed=42, max_tokens=24)
    alone = llm.generate(PROMPTS[1], params, use_tqdm=False)[0].outputs[0].token_ids
    others = [SamplingParams(temperature=0.7, seed=i, max_tokens=30) for i in range(3)]
    batch = llm.generate(
        [PROMPTS[0], PROMPTS[1], PROMPTS[2], PROMPTS[3]],
        [others[0], params, others[1], others[2]],
        use_tqdm=False,
    )
    assert batch[1].outputs[0].token_ids == alone


def test_unseeded_requests_differ(llm):
    params = SamplingParams(temperature=1.0, max_tokens=16)
    a, b = llm.generate([PROMPTS[0], PROMPTS[0]], params, use_tqdm=False)
    assert a.outputs[0].token_ids != b.outputs[0].token_ids


def test_n_samples_equal_individually_seeded_requests(llm):
    params = SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=12)
    (parallel,) = llm.generate(PROMPTS[0], params, use_tqdm=False)
    assert [c.index for c in parallel.outputs] == [0, 1, 2]
    for i, completion in enumerate(parallel.outputs):
        single = llm.generate(PROMPTS[0], params.replace(n=1, seed=7 + i), use_tqdm=False)[0]
        assert completion.token_ids == single.outputs[0].token_ids


def test_n_samples_share_the_prompt_blocks(tiny_llama):
    llm = LLM(str(tiny_llama), show_progress=False, block_size=4, enable_prefix_caching=False)
    prompt = list(range(10, 42))  # 32 tokens = 8 blocks
    engine = llm.engine
    engine.add_request("x", prompt, SamplingParams(n=4, max_tokens=3, seed=1))
    engine.step()  # computes the prompt once, then forks the other three samples
    engine.step()
    # 8 shared prompt blocks + one private block per sample, instead of 4 * 9.
    assert engine.stats().kv_blocks_used <= 8 + 4 + 1
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.stats().kv_blocks_used == 0


def test_greedy_is_deterministic_and_unaffected_by_chunking(tiny_llama, llm):
    params = SamplingParams(temperature=0, max_tokens=20)
    expected = texts(llm.generate(PROMPTS, params, use_tqdm=False))
    chunked = LLM(str(tiny_llama), show_progress=False, max_num_batched_tokens=8)
    assert texts(chunked.generate(PROMPTS, params, use_tqdm=False)) == expected


def test_preemption_under_memory_pressure_gives_same_outputs(tiny_llama, llm):
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    expected = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)]
    # 10 blocks of 8 tokens cannot hold 4 sequences of ~45 tokens at once: requests are preempted.
    small = LLM(str(tiny_llama), show_progress=False, num_kv_blocks=10, block_size=8, max_model_len=64)
    outputs = small.generate(PROMPTS, params, use_tqdm=False)
    assert small.stats()["num_preemptions"] > 0
    assert [o.outputs[0].token_ids for o in outputs] == expected
    assert small.stats()["kv_blocks_used"] == 0


def test_a_preempted_request_recomputes_the_numbers_it_had(checkpoint_factory):
    """After a preemption a sequence recomputes its prompt, then its generated tokens in a step of
    their own, as a row of generated tokens (attending token by token, through the panels), so its
    logprobs are bit for bit those of a run without preemption. A model of 256 inputs, where a
    prompt's kernels round otherwise than decoding's."""
    checkpoint = str(checkpoint_factory("llama", hidden_size=256, intermediate_size=512))
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, logprobs=2)
    options = {"show_progress": False, "block_size": 8, "max_model_len": 64}
    roomy = LLM(checkpoint, **options)
    expected = [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in roomy.generate(PROMPTS, params)]
    small = LLM(checkpoint, num_kv_blocks=10, **options)
    outputs = small.generate(PROMPTS, params)
    assert small.stats()["num_preemptions"] > 0
    assert [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outputs] == expected


def test_stop_string_spanning_tokens(llm):
    base = llm.generate(PROMPTS[0], SamplingParams(temperature=0, max_tokens=20), use_tqdm=False)[0]
    full = base.outputs[0].text
    stop = full[5:9]  # four characters, almost surely spanning a token boundary in a 384-token vocab
    out = llm.generate(PROMPTS[0], SamplingParams(temperature=0, max_tokens=20, stop=[stop]), use_tqdm=False)[
        0
    ]
    first = full.index(stop)
    assert out.outputs[0].text == full[:first]
    assert out.outputs[0].finish_reason == "stop" and out.outputs[0].stop_reason == stop
    kept = llm.generate(
        PROMPTS[0],
        SamplingParams(temperature=0, max_tokens=20, stop=[stop], include_stop_str_in_output=True),
        use_tqdm=False,
    )[0]
    assert kept.outputs[0].text == full[: first + len(stop)]


def test_stop_token_ids_and_min_tokens(llm):
    base = llm.generate(PROMPTS[2], SamplingParams(temperature=0, max_tokens=10), use_tqdm=False)[0]
    first_token = base.outputs[0].token_ids[0]
    out = llm.generate(
        PROMPTS[2], SamplingParams(temperature=0, max_tokens=10, stop_token_ids=[first_token]), use_tqdm=False
    )[0].outputs[0]
    assert out.token_ids == [first_token] and out.finish_reason == "stop" and out.stop_reason == first_token
    later = llm.generate(
        PROMPTS[2],
        SamplingParams(temperature=0, max_tokens=10, min_tokens=3, stop_token_ids=[first_token]),
        use_tqdm=False,
    )[0].outputs[0]
    assert len(later.token_ids) >= 3 and first_token not in later.token_ids[:3]


def test_eos_stops_unless_ignored(tiny_llama):
    llm = LLM(str(tiny_llama), show_progress=False)
    eos_bias = SamplingParams(temperature=0, max_tokens=5, logits_processors=[_prefer_token(0)])
    stopped = llm.generate(PROMPTS[0], eos_bias, use_tqdm=False)[0].outputs[0]
    assert stopped.finish_reason == "stop" and stopped.token_ids == [0] and stopped.text == ""
    ignored = llm.generate(PROMPTS[0], eos_bias.replace(ignore_eos=True), use_tqdm=False)[0].outputs[0]
    assert ignored.finish_reason == "length" and ignored.token_ids == [0] * 5


def _prefer_token(token: int):
    def prefer(token_ids: list[int], logits: torch.Tensor) -> torch.Tensor:
        logits[token] += 100.0
        return logits

    return prefer


def test_max_model_len_finishes_with_length(tiny_llama):
    """Without max_tokens a request generates until the context is full; a max_tokens that does
    not fit beside the prompt is an error naming both numbers (as vLLM), not a silent cut."""
    llm = LLM(str(tiny_llama), show_progress=False, max_model_len=32)
    prompt = [list(range(5, 25))]
    out = llm.generate(prompt, SamplingParams(max_tokens=None, ignore_eos=True), use_tqdm=False)
    assert out[0].outputs[0].finish_reason == "length"
    assert len(out[0].prompt_token_ids) + len(out[0].outputs[0].token_ids) == 32
    fits = llm.generate(prompt, SamplingParams(max_tokens=12, ignore_eos=True), use_tqdm=False)
    assert len(fits[0].outputs[0].token_ids) == 12
    with pytest.raises(ValueError, match=r"prompt \(20 tokens\) plus max_tokens \(13\).*at most 12"):
        llm.generate(prompt, SamplingParams(max_tokens=13, ignore_eos=True), use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()


def test_stream_deltas_add_up_to_generate(llm):
    params = SamplingParams(temperature=0, max_tokens=25)
    full = llm.generate(PROMPTS[1], params, use_tqdm=False)[0].outputs[0]
    chunks = list(llm.stream(PROMPTS[1], params))
    assert chunks[-1].finished and not any(c.finished for c in chunks[:-1])
    assert "".join(c.outputs[0].text for c in chunks) == full.text
    assert [t for c in chunks for t in c.outputs[0].token_ids] == full.token_ids


def test_closing_a_stream_aborts_the_request(llm):
    stream = llm.stream(PROMPTS[0], SamplingParams(max_tokens=50, ignore_eos=True))
    next(stream)
    stream.close()
    assert llm.stats()["kv_blocks_used"] == 0


def test_logprobs_are_consistent(llm):
    params = SamplingParams(temperature=0, max_tokens=6, logprobs=3)
    out = llm.generate(PROMPTS[0], params, use_tqdm=False)[0].outputs[0]
    assert out.logprobs is not None and len(out.logprobs) == 6
    total = 0.0
    for token, position in zip(out.token_ids, out.logprobs, strict=True):
        chosen = position[token]
        assert chosen.rank == 1  # greedy takes the most likely token
        assert chosen.logprob == max(lp.logprob for lp in position.values())
        total += chosen.logprob
    assert out.cumulative_logprob == pytest.approx(total)


def test_chat_uses_the_template(llm):
    (out,) = llm.chat([{"role": "user", "content": "Speak"}], SamplingParams(temperature=0, max_tokens=5))
    expected_ids = llm.get_tokenizer().encode(
        "<|im_start|>user\nSpeak<|im_end|>\n<|im_start|>assistant\n", add_special_tokens=False
    )
    assert out.prompt_token_ids == expected_ids
    assert out.prompt == "<|im_start|>user\nSpeak<|im_end|>\n<|im_start|>assistant\n"  # the rendered chat
    two = llm.chat([[{"role": "user", "content": "a"}], [{"role": "user", "content": "b"}]], use_tqdm=False)
    assert len(two) == 2 and "a<|im_end|>" in two[0].prompt and "b<|im_end|>" in two[1].prompt


def test_show_progress_false_also_quiets_generates_bar(llm, capsys):
    """`LLM(show_progress=False)` (as `llm` here): no bar unless a call asks for one."""
    params = SamplingParams(max_tokens=2)
    llm.generate(["a", "b", "c"], params)
    llm.chat([[{"role": "user", "content": "a"}], [{"role": "user", "content": "b"}]], params)
    assert "it/s" not in capsys.readouterr().err
    llm.generate(["a", "b", "c"], params, use_tqdm=True)
    assert "3/3" in capsys.readouterr().err


def test_stats_report_the_cache(llm):
    stats = llm.stats()
    for key in ("kv_blocks_total", "kv_blocks_used", "prefix_cache_hit_tokens", "num_running", "num_waiting"):
        assert key in stats
    assert stats["kv_blocks_total"] > 0


# ---- bad input ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("temperature", -1.0),
        ("top_p", 0.0),
        ("top_k", -5),
        ("min_p", 1.5),
        ("max_tokens", 0),
        ("n", 0),
        ("presence_penalty", 3.0),
        ("repetition_penalty", 0.0),
        ("logprobs", -1),
        ("stop", [""]),
    ],
)
def test_bad_sampling_params_name_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})


def test_bad_prompts_fail_alone(llm):
    engine = llm.engine
    engine.add_request("good", PROMPTS[0], SamplingParams(temperature=0, max_tokens=8))
    engine.step()
    with pytest.raises(ValueError, match="empty"):
        engine.add_request("empty", [], SamplingParams())
    with pytest.raises(ValueError, match="outside the vocabulary"):
        engine.add_request("oov", [1, 10**6], SamplingParams())
    with pytest.raises(ValueError, match="max_model_len"):
        engine.add_request("long", [5] * 10_000, SamplingParams())
    with pytest.raises(ValueError, match="already in use"):
        engine.add_request("good", PROMPTS[0], SamplingParams())
    finished = []
    while engine.has_unfinished_requests():
        finished += [o for o in engine.step() if o.finished]
    assert [o.request_id for o in finished] == ["good"]
    assert len(finished[0].outputs[0].token_ids) == 8


def test_failing_logits_processor_fails_only_its_request(llm):
    def broken(token_ids, logits):
        raise RuntimeError("boom")

    params = [
        SamplingParams(temperature=0, max_tokens=6),
        SamplingParams(max_tokens=6, logits_processors=[broken]),
        SamplingParams(temperature=0, max_tokens=6),
    ]
    outputs = llm.generate(PROMPTS[:3], params, use_tqdm=False)
    assert outputs[1].outputs[0].finish_reason == "error" and "boom" in outputs[1].outputs[0].error
    assert outputs[1].outputs[0].token_ids == []
    expected = llm.generate(
        [PROMPTS[0], PROMPTS[2]], SamplingParams(temperature=0, max_tokens=6), use_tqdm=False
    )
    assert texts([outputs[0], outputs[2]]) == texts(expected)


def test_params_list_must_match_prompts(llm):
    with pytest.raises(ValueError, match="one per prompt"):
        llm.generate(PROMPTS, [SamplingParams()] * 2)


def test_stop_string_on_the_last_allowed_token_reports_stop(llm):
    base = llm.generate(PROMPTS[0], SamplingParams(temperature=0, max_tokens=6), use_tqdm=False)[0].outputs[0]
    tokenizer = llm.get_tokenizer()
    prefix = tokenizer.decode(base.token_ids[:5])
    stop = base.text[len(prefix) - 1 :]  # ends exactly with the 6th token's text
    out = llm.generate(PROMPTS[0], SamplingParams(temperature=0, max_tokens=6, stop=[stop]), use_tqdm=False)[
        0
    ]
    assert out.outputs[0].finish_reason == "stop" and out.outputs[0].stop_reason == stop


# ---- sequences, groups and the output router ------------------------------------------------


def test_n_beyond_max_num_seqs_with_a_grammar_completes(tiny_llama):
    llm = LLM(str(tiny_llama), show_progress=False, max_num_seqs=2)
    params = SamplingParams(n=3, regex="[0-9]{3}", temperature=1.0, seed=4, max_tokens=10)
    outputs = llm.generate(["a", "b"], params, use_tqdm=False)
    for out in outputs:
        assert [c.index for c in out.outputs] == [0, 1, 2]
        for completion in out.outputs:
            assert completion.finish_reason == "stop" and re.fullmatch("[0-9]{3}", completion.text)
    assert llm.stats()["kv_blocks_used"] == 0


def test_request_ids_with_hash_signs_do_not_collide(llm):
    engine = llm.engine
    engine.add_request("x", PROMPTS[0], SamplingParams(n=2, temperature=0, max_tokens=4))
    engine.add_request("x#1", PROMPTS[1], SamplingParams(temperature=0, max_tokens=6))
    finished = {}
    while engine.has_unfinished_requests():
        finished.update({o.request_id: o for o in engine.step() if o.finished})
    assert sorted(finished) == ["x", "x#1"]
    assert [len(c.token_ids) for c in finished["x"].outputs] == [4, 4]
    assert len(finished["x#1"].outputs) == 1 and len(finished["x#1"].outputs[0].token_ids) == 6


def test_a_stream_keeps_its_deltas_while_generate_runs(llm):
    params = SamplingParams(max_tokens=20, seed=1, ignore_eos=True)
    solo = llm.generate(PROMPTS[3], params, use_tqdm=False)[0].outputs[0]
    stream = llm.stream(PROMPTS[3], params)
    first = next(stream)
    others = llm.generate(
        [PROMPTS[0], PROMPTS[1]], SamplingParams(temperature=0, max_tokens=12), use_tqdm=False
    )
    rest = list(stream)
    assert all(o.finished for o in others)
    chunks = [first, *rest]
    assert "".join(c.outputs[0].text for c in chunks) == solo.text
    assert [t for c in chunks for t in c.outputs[0].token_ids] == solo.token_ids


def test_two_streams_interleaved(llm):
    params = SamplingParams(temperature=0, max_tokens=15, ignore_eos=True)
    solo = [o.outputs[0].text for o in llm.generate(PROMPTS[:2], params, use_tqdm=False)]
    a, b = llm.stream(PROMPTS[0], params), llm.stream(PROMPTS[1], params)
    texts_a, texts_b = [next(a).outputs[0].text], []
    texts_b += [c.outputs[0].text for c in b]
    texts_a += [c.outputs[0].text for c in a]
    assert ["".join(texts_a), "".join(texts_b)] == solo


def test_non_finite_logits_fail_only_their_request(llm):
    def nan_row(token_ids, logits):
        return torch.full_like(logits, float("nan"))

    def all_masked(token_ids, logits):
        return torch.full_like(logits, float("-inf"))

    params = [
        SamplingParams(temperature=0, max_tokens=6),
        SamplingParams(temperature=0, max_tokens=6, logits_processors=[nan_row]),
        SamplingParams(temperature=0.8, seed=3, max_tokens=6, logits_processors=[all_masked]),
        SamplingParams(temperature=0, max_tokens=6),
    ]
    outputs = llm.generate(PROMPTS, params, use_tqdm=False)
    for out in outputs[1:3]:
        completion = out.outputs[0]
        assert completion.finish_reason == "error" and "not finite" in completion.error
        assert completion.token_ids == []
    expected = llm.generate(
        [PROMPTS[0], PROMPTS[3]], SamplingParams(temperature=0, max_tokens=6), use_tqdm=False
    )
    assert texts([outputs[0], outputs[3]]) == texts(expected)


def test_too_many_logprobs_is_rejected_before_queueing(llm):
    with pytest.raises(ValueError, match="max_logprobs"):
        llm.generate(PROMPTS[0], SamplingParams(logprobs=1_000_000), use_tqdm=False)
    with pytest.raises(ValueError, match="max_logprobs"):
        llm.generate(PROMPTS[0], SamplingParams(logprobs=21), use_tqdm=False)
    assert len(llm.generate(PROMPTS[0], SamplingParams(logprobs=20, max_tokens=2), use_tqdm=False)) == 1


def test_stop_token_ids_outside_the_vocabulary_are_rejected(llm):
    with pytest.raises(ValueError, match="stop_token_ids"):
        llm.generate(PROMPTS[0], SamplingParams(stop_token_ids=[10**7]), use_tqdm=False)


def test_invalid_unicode_is_a_value_error_naming_the_field(llm):
    with pytest.raises(ValueError, match="prompt is not valid Unicode"):
        llm.generate("a\ud800b", SamplingParams(max_tokens=2), use_tqdm=False)
    with pytest.raises(ValueError, match="stop"):
        SamplingParams(stop=["x\udfffy"])
    with pytest.raises(ValueError, match=r"messages\[0\].content"):
        llm.chat([{"role": "user", "content": 42}], SamplingParams(max_tokens=2))
    with pytest.raises(ValueError, match=r"messages\[1\].content"):
        llm.chat([{"role": "user", "content": "ok"}, {"role": "user", "content": "\ud800"}])
    with pytest.raises(ValueError, match="prompt"):
        llm.generate([[1, 2.5]], SamplingParams(max_tokens=2), use_tqdm=False)


def test_logprobs_do_not_change_the_tokens(llm):
    """A mixed batch, some rows with logprobs (raw and processed, sampled prompt logprobs too), gives
    the same tokens as the same batch without any."""
    base = [
        SamplingParams(temperature=0.8, seed=i, max_tokens=10, top_p=0.9 if i % 2 else 1.0) for i in range(4)
    ]
    plain = llm.generate(PROMPTS, base, use_tqdm=False)
    asking = [
        base[0].replace(logprobs=3),
        base[1],
        base[2].replace(logprobs=1, logprobs_mode="processed", prompt_logprobs=2),
        base[3],
    ]
    mixed = llm.generate(PROMPTS, asking, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in mixed] == [o.outputs[0].token_ids for o in plain]
    assert mixed[0].outputs[0].logprobs and mixed[1].outputs[0].logprobs is None


def test_vllm_prompt_dicts_are_their_text_or_token_ids(llm):
    """vLLM's TextPrompt and TokensPrompt ({"prompt": ...}, {"prompt_token_ids": ...}) are the
    prompts they hold, alone or in a list, in generate, stream and score; anything else in a
    prompt dict is refused with the keys weft reads."""
    ids = llm.tokenizer.encode("First Citizen:", add_special_tokens=False)
    greedy = SamplingParams(max_tokens=6, temperature=0)
    (want,) = llm.generate([ids], greedy)
    for prompt in ({"prompt_token_ids": ids}, [{"prompt_token_ids": ids}], {"prompt": "First Citizen:"}):
        (got,) = llm.generate(prompt, greedy)
        assert (got.prompt_token_ids, got.outputs[0].token_ids) == (ids, want.outputs[0].token_ids)
    streamed = [t for out in llm.stream({"prompt_token_ids": ids}, greedy) for t in out.outputs[0].token_ids]
    assert streamed == want.outputs[0].token_ids
    assert llm.score({"prompt_token_ids": ids}, [" a"]) == llm.score(ids, [" a"])
    with pytest.raises(ValueError, match=r"'prompt' \(text\) or 'prompt_token_ids'.*multi_modal_data"):
        llm.generate({"prompt": "x", "multi_modal_data": {}}, greedy)
    with pytest.raises(ValueError, match="'prompt_token_ids' must be a list of ints"):
        llm.generate({"prompt_token_ids": "First"}, greedy)
