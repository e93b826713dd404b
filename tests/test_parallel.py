"""Parallel generation of one prompt: best_of, beam search and exact choice scoring, against
transformers on tiny random checkpoints, and the KV blocks they use."""

from __future__ import annotations

import json
import re

import jsonschema
import lark
import pytest
import torch
import transformers

from weft import LLM, BeamSearchParams, SamplingParams
from weft.engine.sequence import Sequence
from weft.structured import llguidance_backend

ON_CPU = {"device": "cpu", "dtype": "float32"}
BEAM_PROMPTS = [[5, 17, 42, 99, 100, 7], [11, 12, 13], [3], [200, 201, 202, 203]]


@pytest.fixture(scope="module")
def llm(tiny_llama) -> LLM:
    return LLM(str(tiny_llama), show_progress=False, **ON_CPU)


@pytest.fixture(scope="module")
def reference(tiny_llama):
    return transformers.AutoModelForCausalLM.from_pretrained(tiny_llama).eval()


# Two EOS ids, one of them a token this random model often picks, so that beams do end at EOS.
EOS_IDS = [0, 268]


@pytest.fixture(scope="module")
def eos_path(checkpoint_factory):
    return checkpoint_factory("llama", eos_token_id=EOS_IDS)


@pytest.fixture(scope="module")
def eos_llm(eos_path) -> LLM:
    return LLM(str(eos_path), show_progress=False, **ON_CPU)


@pytest.fixture(scope="module")
def eos_reference(eos_path):
    return transformers.AutoModelForCausalLM.from_pretrained(eos_path).eval()


def reference_beams(reference, prompt, width, max_tokens, length_penalty, early_stopping, ignore_eos):
    """transformers' beams: (generated tokens without padding, score), best first."""
    options = {"eos_token_id": None} if ignore_eos else {}
    out = reference.generate(
        torch.tensor([prompt]),
        num_beams=width,
        num_return_sequences=width,
        do_sample=False,
        max_new_tokens=max_tokens,
        length_penalty=length_penalty,
        early_stopping=early_stopping,
        output_scores=True,
        return_dict_in_generate=True,
        pad_token_id=0,
        **options,
    )
    beams = []
    for i in range(width):
        tokens = out.sequences[i, len(prompt) :].tolist()
        ends = [i for i, t in enumerate(tokens) if t in EOS_IDS]
        if not ignore_eos and ends:  # EOS ends it; the rest is padding
            tokens = tokens[: ends[0] + 1]
        score = out.sequences_scores[i].item() if width > 1 else None
        beams.append((tokens, score))
    return beams


@pytest.mark.parametrize("width", [1, 2, 4, 8])
def test_beam_search_equals_transformers(eos_llm, eos_reference, width):
    llm, reference = eos_llm, eos_reference
    ended_at_eos = 0
    for length_penalty, early_stopping in ((1.0, False), (0.0, False), (0.5, True), (2.0, "never")):
        for ignore_eos in (False, True):
            params = BeamSearchParams(
                beam_width=width,
                max_tokens=10,
                length_penalty=length_penalty,
                early_stopping=early_stopping,
                ignore_eos=ignore_eos,
            )
            results = llm.beam_search(BEAM_PROMPTS, params, use_tqdm=False)
            for prompt, result in zip(BEAM_PROMPTS, results, strict=True):
                expected = reference_beams(
                    reference, prompt, width, 10, length_penalty, early_stopping, ignore_eos
                )
                assert len(result.sequences) == width
                best = result.sequences[0]
                assert best.token_ids == expected[0][0], (prompt, params)
                if width > 1:  # transformers reports no score for greedy search
                    for beam, (tokens, score) in zip(result.sequences, expected, strict=True):
                        assert beam.token_ids == tokens
                        assert beam.score == pytest.approx(score, abs=1e-4)
                scores = [b.score for b in result.sequences]
                assert scores == sorted(scores, reverse=True)
                ended_at_eos += sum(b.finish_reason == "stop" for b in result.sequences)
                if ignore_eos:
                    assert all(len(b.token_ids) == 10 for b in result.sequences)
    if width >= 4:
        assert ended_at_eos > 0, "no beam reached EOS: the EOS path was not exercised"


def test_beam_score_is_the_length_normalised_logprob(llm):
    (result,) = llm.beam_search([BEAM_PROMPTS[0]], BeamSearchParams(beam_width=3, max_tokens=6))
    vocab = llm.config.model.vocab_size
    for beam in result.sequences:
        # Recompute the logprob of the beam's tokens by teacher forcing them as a prompt.
        (out,) = llm.generate(
            [BEAM_PROMPTS[0] + beam.token_ids],
            SamplingParams(max_tokens=1, prompt_logprobs=0),
            use_tqdm=False,
        )
        positions = out.prompt_logprobs[len(BEAM_PROMPTS[0]) :]
        total = sum(p[t].logprob for p, t in zip(positions, beam.token_ids, strict=True))
        assert beam.cumulative_logprob == pytest.approx(total, abs=1e-4)
        assert beam.score == pytest.approx(total / len(beam.token_ids), abs=1e-4)
        assert all(0 <= t < vocab for t in beam.token_ids)


class Counting:
    """Counts the tokens every grammar matcher consumes and the tokens sequences append."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.consumed = 0
        self.appended = 0
        consume = llguidance_backend.LLGuidanceMatcher.consume
        append = Sequence.append

        def counting_consume(matcher, token_ids):
            self.consumed += len(token_ids)
            return consume(matcher, token_ids)

        def counting_append(seq, token_id, logprobs=None):
            if seq.matcher is not None:
                self.appended += 1
            return append(seq, token_id, logprobs)

        monkeypatch.setattr(llguidance_backend.LLGuidanceMatcher, "consume", counting_consume)
        monkeypatch.setattr(Sequence, "append", counting_append)


SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "age": {"type": "integer", "minimum": 0, "maximum": 99},
    },
    "required": ["name", "age"],
    "additionalProperties": False,
}
GRAMMAR = 'start: greeting " " NAME\ngreeting: "hi" | "hello"\nNAME: /[a-z]{2,5}/\n'


@pytest.mark.parametrize(
    ("constraint", "check"),
    [
        ({"json_schema": SCHEMA}, lambda text: jsonschema.validate(json.loads(text), SCHEMA)),
        ({"regex": r"[a-z]{3,6}-[0-9]{2}"}, lambda text: re.fullmatch(r"[a-z]{3,6}-[0-9]{2}", text) or 1 / 0),
        ({"grammar": GRAMMAR}, lambda text: lark.Lark(GRAMMAR).parse(text)),
    ],
    ids=["json_schema", "regex", "grammar"],
)
def test_constrained_beams_are_valid_and_matchers_are_forked(llm, monkeypatch, constraint, check):
    counting = Counting(monkeypatch)
    params = BeamSearchParams(beam_width=4, max_tokens=40, **constraint)
    (result,) = llm.beam_search(["A record:"], params)
    assert result.error is None and len(result.sequences) == 4
    for beam in result.sequences:
        assert beam.finish_reason == "stop", beam
        check(beam.text)
    # Each appended token is consumed once, by the matcher of the sequence that appends it: the
    # matchers of new beams are forks of their parents' states, never replays of their tokens.
    assert counting.consumed == counting.appended > 0


def test_best_of_returns_the_most_probable_samples(llm):
    prompt = [5, 17, 42]
    (all_samples,) = llm.generate([prompt], SamplingParams(n=6, seed=11, max_tokens=8, logprobs=0))
    (best,) = llm.generate([prompt], SamplingParams(n=2, best_of=6, seed=11, max_tokens=8))
    ranked = sorted(all_samples.outputs, key=lambda c: -c.cumulative_logprob)
    assert [c.token_ids for c in best.outputs] == [c.token_ids for c in ranked[:2]]
    assert [c.index for c in best.outputs] == [0, 1]
    assert best.outputs[0].cumulative_logprob == pytest.approx(ranked[0].cumulative_logprob)
    assert best.outputs[0].logprobs is None  # not asked for, only used for the ranking


def test_best_of_streams_only_its_final_result(llm):
    outputs = list(llm.stream([5, 17, 42], SamplingParams(n=1, best_of=3, seed=1, max_tokens=5)))
    assert len(outputs) == 1 and outputs[0].finished and len(outputs[0].outputs) == 1


def step_until_done(llm: LLM, request_id: str, prompt, params) -> int:
    """Run one request alone through the engine; return the most KV blocks in use at once."""
    engine = llm.engine
    engine.add_request(request_id, prompt, params)
    peak = 0
    while engine.has_unfinished_requests():
        engine.step()
        peak = max(peak, engine.kv.num_used_blocks)
    return peak


@pytest.fixture(scope="module")
def long_llm(checkpoint_factory) -> LLM:
    path = checkpoint_factory("llama", max_position_embeddings=1024)
    return LLM(str(path), show_progress=False, max_num_seqs=32, enable_prefix_caching=False, **ON_CPU)


@pytest.mark.parametrize(
    "params", [SamplingParams(n=16), SamplingParams(n=1, best_of=16)], ids=["n", "best_of"]
)
def test_samples_share_the_prompt_blocks(long_llm, params):
    block_size = long_llm.config.cache.block_size
    prompt = [(7 * i) % 300 + 3 for i in range(512)]
    max_tokens = 40
    params = params.replace(max_tokens=max_tokens, ignore_eos=True, temperature=1.0, seed=3)
    peak = step_until_done(long_llm, "shared", prompt, params)
    prompt_blocks = len(prompt) // block_size
    generated_blocks = -(-max_tokens // block_size)
    assert peak <= prompt_blocks + 16 * (generated_blocks + 1)
    assert long_llm.engine.kv.num_used_blocks == 0


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(n=8, max_tokens=30, ignore_eos=True),
        BeamSearchParams(beam_width=6, max_tokens=30, ignore_eos=True),
    ],
    ids=["samples", "beams"],
)
def test_abort_frees_every_block_of_every_child(long_llm, params):
    engine = long_llm.engine
    engine.add_request("aborted", list(range(3, 100)), params)
    for _ in range(8):
        engine.step()
    assert engine.kv.num_used_blocks > 0
    engine.abort_request("aborted")
    assert engine.kv.num_used_blocks == 0
    assert not engine.has_unfinished_requests()
    stats = long_llm.stats()
    assert stats["num_running"] == 0 and stats["num_waiting"] == 0


def test_beams_of_many_prompts_batch_with_other_requests(llm):
    engine = llm.engine
    engine.add_request("plain", [4, 5, 6], SamplingParams(max_tokens=12, temperature=0))
    engine.add_request("beams-a", [11, 12, 13], BeamSearchParams(beam_width=3, max_tokens=8))
    engine.add_request("beams-b", [3], BeamSearchParams(beam_width=2, max_tokens=8))
    finished = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out
    assert set(finished) == {"plain", "beams-a", "beams-b"}
    (alone,) = llm.beam_search([[11, 12, 13]], BeamSearchParams(beam_width=3, max_tokens=8))
    assert [c.token_ids for c in finished["beams-a"].outputs] == [b.token_ids for b in alone.sequences]


# ---- choice scoring -----------------------------------------------------------------------------

PROMPT = "First Citizen: Before we"
OPTIONS = [" proceed any further", " proceed", " know't", " speak", " proceed any", "Café"]


def test_score_equals_transformers_log_softmax(llm, reference):
    scores = llm.score(PROMPT, OPTIONS)
    assert [s.text for s in scores] == OPTIONS
    for s in scores:
        full = llm.tokenizer.encode(PROMPT + s.text)
        start = len(full) - len(s.token_ids)
        assert full[start:] == s.token_ids
        with torch.no_grad():
            logprobs = torch.log_softmax(reference(torch.tensor([full])).logits[0].double(), dim=-1)
        expected = [logprobs[t - 1, full[t]].item() for t in range(start, len(full))]
        assert s.token_logprobs == pytest.approx(expected, abs=1e-4)
        assert s.logprob == pytest.approx(sum(expected), abs=1e-4)


def test_score_computes_each_shared_prefix_once(llm):
    prompt_ids = llm.tokenizer.encode(PROMPT)
    before = llm.stats()["num_scored_tokens"]
    scores = llm.score(PROMPT, OPTIONS)
    computed = llm.stats()["num_scored_tokens"] - before
    # One node per distinct prefix of (prompt + option), but each option's complete sequence.
    full = [llm.tokenizer.encode(PROMPT + s.text) for s in scores]
    prefixes = {tuple(ids[:n]) for ids in full for n in range(1, len(ids))}
    assert computed == len(prefixes)
    assert computed < sum(len(ids) - 1 for ids in full)  # shared prefixes were not recomputed
    assert all(ids[: len(prompt_ids) - 1] == prompt_ids[:-1] for ids in full)


def test_score_attributes_merged_boundary_tokens_to_the_option(llm):
    # "speak" after "speak" merges with nothing, but a prompt ending mid-word merges with the option.
    prompt = "First Citizen: Before we pro"
    (score,) = llm.score(prompt, ["ceed"])
    prompt_ids = llm.tokenizer.encode(prompt)
    full = llm.tokenizer.encode(prompt + "ceed")
    start = len(full) - len(score.token_ids)
    assert full[:start] == prompt_ids[:start]
    if start < len(prompt_ids):  # the tokenizer merged "pro" + "ceed": that token is the option's
        assert llm.tokenizer.decode(score.token_ids).endswith("ceed")
        assert len(llm.tokenizer.decode(score.token_ids)) > len("ceed")


def test_exact_choice_returns_the_most_probable_option_where_greedy_does_not(llm):
    words = [" proceed", " speak", " know't", " famish", " resolved", " enemy", " Marcius", " die"]
    disagreements = 0
    for i in range(len(words)):
        for j in range(i + 1, len(words)):
            options = [words[i], words[j]]
            scores = llm.score(PROMPT, options)
            best = max(scores, key=lambda s: s.logprob).text
            (exact,) = llm.generate(PROMPT, SamplingParams(choice=options, choice_selection="exact"))
            (greedy,) = llm.generate(PROMPT, SamplingParams(choice=options, temperature=0))
            assert exact.outputs[0].text == best
            disagreements += greedy.outputs[0].text != best
    assert disagreements > 0, "no option pair where token-by-token greedy misses the most probable option"


def test_exact_choice_returns_n_options_best_first(llm):
    (out,) = llm.generate(PROMPT, SamplingParams(choice=OPTIONS, choice_selection="exact", n=3))
    scores = sorted(llm.score(PROMPT, OPTIONS), key=lambda s: -s.logprob)
    assert [c.text for c in out.outputs] == [s.text for s in scores[:3]]
    assert [c.index for c in out.outputs] == [0, 1, 2]
    assert out.outputs[0].cumulative_logprob == pytest.approx(scores[0].logprob)
    assert all(c.finish_reason == "stop" for c in out.outputs)


@pytest.mark.parametrize(
    ("params", "message"),
    [
        (lambda: SamplingParams(choice=["a", "b"], choice_selection="exact", n=3), "more options"),
        (lambda: SamplingParams(choice=["a"], choice_selection="exact", logprobs=1), "cumulative_logprob"),
        (lambda: SamplingParams(choice_selection="exact"), "needs a `choice`"),
        (lambda: SamplingParams(n=3, best_of=2), "best_of"),
        (lambda: BeamSearchParams(beam_width=0), "beam_width"),
        (lambda: BeamSearchParams(beam_width=2, early_stopping="sometimes"), "early_stopping"),
        (lambda: BeamSearchParams(beam_width=2, stop=[""]), "BeamSearchParams.stop"),
    ],
)
def test_bad_parameters_fail_alone_with_a_clear_message(llm, params, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        llm.generate([3, 4], params(), use_tqdm=False)
    (ok,) = llm.generate([3, 4], SamplingParams(max_tokens=2), use_tqdm=False)
    assert ok.outputs[0].finish_reason is not None


@pytest.mark.parametrize("options", [[], [""], "abc"])
def test_score_rejects_bad_options(llm, options):
    with pytest.raises(ValueError, match="options"):
        llm.score(PROMPT, options)


def test_beams_that_hit_a_stop_string_finish_as_hypotheses(llm):
    params = BeamSearchParams(beam_width=4, max_tokens=12, stop=["e"])
    results = llm.beam_search(BEAM_PROMPTS, params, use_tqdm=False)
    stopped = 0
    for result in results:
        assert result.error is None and 1 <= len(result.sequences) <= 4
        for beam in result.sequences:
            assert "e" not in beam.text
            assert beam.finish_reason in ("stop", "length")
            stopped += beam.stop_reason == "e"
        scores = [b.score for b in result.sequences]
        assert scores == sorted(scores, reverse=True)
    assert stopped > 0


def test_beams_that_cannot_fit_in_the_cache_fail_alone(tiny_llama):
    small = LLM(str(tiny_llama), num_kv_blocks=8, max_model_len=128, show_progress=False, **ON_CPU)
    engine = small.engine
    engine.add_request("plain", [4, 5, 6], SamplingParams(max_tokens=20, temperature=0))
    engine.add_request("beams", [5, 6, 7], BeamSearchParams(beam_width=8, max_tokens=100, ignore_eos=True))
    finished = {}
    for _ in range(500):
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out
        if not engine.has_unfinished_requests():
            break
    assert set(finished) == {"plain", "beams"}, "the engine stalled"
    assert "cannot hold this request's sequences" in finished["beams"].outputs[0].error
    assert len(finished["plain"].outputs[0].token_ids) == 20
    assert small.stats()["kv_blocks_used"] == 0 and small.stats()["num_parked"] == 0


def test_samples_draw_their_first_token_from_the_prompt_logits(tiny_llama):
    """The other samples of n > 1 sample from the first's logits row in the step that ends the
    prompt and share all its blocks: with a block-aligned prompt nothing is recomputed or copied,
    so KV peaks at exactly the prompt's blocks plus each sample's own."""
    llm = LLM(str(tiny_llama), max_num_seqs=8, enable_prefix_caching=False, show_progress=False, **ON_CPU)
    block = llm.config.cache.block_size
    prompt = [(5 * i) % 300 + 3 for i in range(2 * block)]
    params = SamplingParams(n=4, max_tokens=block, ignore_eos=True, seed=7)
    peak = step_until_done(llm, "fan", prompt, params)
    assert peak == 2 + 4  # the prompt's 2 blocks, then one block of its own per sample
    (together,) = llm.generate([prompt], params)
    for i, completion in enumerate(together.outputs):
        (alone,) = llm.generate([prompt], params.replace(n=1, seed=7 + i))
        assert completion.token_ids == alone.outputs[0].token_ids  # sample i of n uses seed + i
