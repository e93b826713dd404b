"""Every weft feature on every family (tiny random checkpoints, float32 on CPU): a JSON-schema request,
top-5 logprobs, beams, exact choice scoring, n=4 and speculative decoding give valid results, and
results that agree with each other (a beam's or a choice's logprob is the teacher-forced one; a
speculative request's tokens are those without speculation). Prompts run past the sliding windows
of the families that have them (8 keys)."""

from __future__ import annotations

import json

import jsonschema
import pytest

from weft import LLM, SamplingParams
from weft.params import BeamSearchParams

FAMILIES = {  # name -> (checkpoint arch, overrides)
    "llama": ("llama", {}),
    "mistral-window": ("mistral", {"sliding_window": 8}),
    "qwen2": ("qwen2", {}),
    "qwen3": ("qwen3", {}),
    "granite": ("granite", {}),
    "smollm3": ("smollm3", {}),
    "olmo2": ("olmo2", {}),
    "phi3": ("phi3", {}),
    "gemma2": ("gemma2", {}),
    "gemma3": ("gemma3", {}),
    "qwen3moe": ("qwen3moe", {}),
    "qwen2moe": ("qwen2moe", {}),
    "mixtral": ("mixtral", {}),
    "olmoe": ("olmoe", {}),
    "gptoss": ("gptoss", {}),
}
PROMPT = "First Citizen: Before we proceed any further, hear me speak. All: Speak, speak."
SCHEMA = {
    "type": "object",
    "properties": {"who": {"enum": ["Citizen", "Marcius"]}, "resolved": {"type": "boolean"}},
    "required": ["who", "resolved"],
    "additionalProperties": False,
}
OPTIONS = {"device": "cpu", "dtype": "float32", "show_progress": False, "max_logprobs": 5}


def _teacher_forced(llm: LLM, prompt_ids: list[int], tokens: list[int]) -> float:
    """The sum of the logprobs of `tokens` after `prompt_ids`, from prompt logprobs."""
    (out,) = llm.generate(
        [prompt_ids + tokens], SamplingParams(max_tokens=1, prompt_logprobs=0), use_tqdm=False
    )
    steps = out.prompt_logprobs[len(prompt_ids) :]
    return sum(step[token].logprob for step, token in zip(steps, tokens, strict=True))


@pytest.mark.parametrize("family", list(FAMILIES))
def test_every_feature_on_every_family(checkpoint_factory, family):
    arch, overrides = FAMILIES[family]
    llm = LLM(str(checkpoint_factory(arch, **overrides)), **OPTIONS)
    prompt_ids = llm.get_tokenizer().encode(PROMPT)
    assert len(prompt_ids) > 8  # past the sliding windows

    (out,) = llm.generate([PROMPT], SamplingParams(json_schema=SCHEMA, max_tokens=60), use_tqdm=False)
    jsonschema.validate(json.loads(out.outputs[0].text), SCHEMA)

    (out,) = llm.generate([PROMPT], SamplingParams(max_tokens=6, logprobs=5, temperature=0), use_tqdm=False)
    for token, top in zip(out.outputs[0].token_ids, out.outputs[0].logprobs, strict=True):
        ranked = sorted(top.values(), key=lambda lp: lp.rank)
        assert len(top) >= 5 and top[token].rank == 1
        assert ranked[0].logprob == max(lp.logprob for lp in ranked)

    (beams,) = llm.beam_search([PROMPT], BeamSearchParams(beam_width=3, max_tokens=5))
    assert len(beams.sequences) == 3
    best = beams.sequences[0]
    forced = _teacher_forced(llm, prompt_ids, best.token_ids)
    assert best.cumulative_logprob == pytest.approx(forced, abs=1e-3)

    scores = llm.score(PROMPT, [" Speak", " hear me", " Resolved."])
    for choice in scores:
        assert choice.logprob == pytest.approx(_teacher_forced(llm, prompt_ids, choice.token_ids), abs=1e-3)

    (out,) = llm.generate([PROMPT], SamplingParams(n=4, max_tokens=5, seed=1), use_tqdm=False)
    assert len(out.outputs) == 4 and all(len(c.token_ids) == 5 for c in out.outputs)

    spec = LLM(
        str(checkpoint_factory(arch, **overrides)),
        speculative_config={"method": "suffix", "num_speculative_tokens": 3},
        **OPTIONS,
    )
    spec.engine.speculation.adaptive = False  # every proposed draft verified: no step timing decides
    greedy = SamplingParams(max_tokens=32, temperature=0)
    looping = PROMPT + " Speak, speak." * 3  # drafts from the prompt's own repeats, whatever the model says
    (with_drafts,), (without,) = (m.generate([looping], greedy, use_tqdm=False) for m in (spec, llm))
    assert with_drafts.outputs[0].token_ids == without.outputs[0].token_ids
    assert spec.stats()["spec_decode_num_draft_tokens"] > 0
    assert llm.stats()["kv_blocks_used"] == 0 and spec.stats()["kv_blocks_used"] == 0
