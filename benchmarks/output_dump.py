"""Dump the outputs of a fixed set of requests, to compare two versions of the engine byte for byte.

    python benchmarks/output_dump.py OUT.txt

On the bundled model, on CPU in float32: every request kind a refactoring of the engine must leave
unchanged (greedy, seeded top-p with logprobs, n, best_of, stop strings, a JSON schema with prompt
logprobs, a regex, choices, exact choice, penalties, streams, beams, `score`, SMC), through a KV
pool small enough to preempt, then again with speculation (n-gram drafts, every draft verified),
with lookahead, and on two tensor-parallel ranks. Run it at two commits and `cmp` the files.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from typing import Any

from weft import LLM, BeamSearchParams, SamplingParams, bundled_model_path

PROMPTS = ["To be, or not to be", "ROMEO:\nBut soft", "First Citizen:\n", "KING HENRY:\nOnce more"]
SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 12}, "age": {"type": "integer"}},
    "required": ["name", "age"],
}
BASE: dict[str, Any] = {"show_progress": False, "device": "cpu", "dtype": "float32", "seed": 7}


def requests() -> Iterator[tuple[str, SamplingParams]]:
    """The sampling request kinds, each by name."""
    yield "greedy", SamplingParams(temperature=0.0, max_tokens=24)
    yield "top_p", SamplingParams(temperature=0.9, top_p=0.8, seed=3, max_tokens=24, logprobs=3)
    yield "n4", SamplingParams(temperature=1.0, n=4, seed=5, max_tokens=16, logprobs=1)
    yield "best_of", SamplingParams(temperature=1.0, n=2, best_of=4, seed=9, max_tokens=16)
    yield "stop", SamplingParams(temperature=0.8, seed=1, max_tokens=40, stop=["e", "\n\n"], logprobs=2)
    yield (
        "json",
        SamplingParams(
            temperature=0.7, seed=2, max_tokens=48, json_schema=SCHEMA, logprobs=2, prompt_logprobs=2
        ),
    )
    yield "regex", SamplingParams(temperature=0.7, seed=4, max_tokens=24, regex="(yes|no), [a-z]{2,8}!")
    yield "choice", SamplingParams(temperature=0.0, choice=["ROMEO", "JULIET", "NURSE"], logprobs=1)
    yield "exact_choice", SamplingParams(choice=["ROMEO", "JULIET", "NURSE"], choice_selection="exact", n=2)
    yield "penalties", SamplingParams(
        temperature=0.8, seed=6, max_tokens=24, presence_penalty=0.5, frequency_penalty=0.3,
        repetition_penalty=1.2, min_p=0.05, min_tokens=8,
    )  # fmt: skip
    yield (
        "smc",
        SamplingParams(
            temperature=1.0, seed=8, max_tokens=12, regex="[a-z]+ [a-z]+", smc={"num_particles": 4}
        ),
    )


def show(value: object) -> str:
    return repr(value)


def dump_all(llm: LLM, label: str, out: list[str]) -> None:
    for name, params in requests():
        for output in llm.generate(PROMPTS, params):
            out.append(f"{label} {name} {show(output.outputs)}")
            out.append(f"{label} {name} prompt_logprobs {show(output.prompt_logprobs)}")
            out.append(f"{label} {name} smc {show(output.smc)}")
    stream = SamplingParams(
        temperature=0.8,
        seed=11,
        max_tokens=20,
        logprobs=1,
        stop=["th"],
        output_kind="delta",
        json_schema=SCHEMA,
    )
    for prompt in PROMPTS[:2]:
        for part in llm.stream(prompt, stream):
            out.append(f"{label} stream {show(part.outputs)}")
    beams = llm.beam_search(PROMPTS[:2], BeamSearchParams(beam_width=3, max_tokens=12))
    out.append(f"{label} beams {show(beams)}")
    out.append(f"{label} score {show(llm.score(PROMPTS[0], ['!', ' said he', ' nay']))}")
    out.append(f"{label} stats {show(sorted(llm.stats().items()))}")


def main(path: str) -> None:
    model = str(bundled_model_path())
    out: list[str] = []
    dump_all(LLM(model, num_kv_blocks=20, block_size=8, max_model_len=128, **BASE), "plain", out)
    spec = LLM(model, speculative_config={"num_speculative_tokens": 4}, **BASE)
    spec.engine.speculation.adaptive = False  # every proposed draft is verified
    dump_all(spec, "speculation", out)
    dump_all(LLM(model, async_scheduling=True, **BASE), "lookahead", out)
    two = LLM(model, tensor_parallel_size=2, **BASE)
    for name, params in requests():
        if name in ("exact_choice",):  # one rank only
            continue
        for output in two.generate(PROMPTS, params):
            out.append(f"tp2 {name} {show(output.outputs)}")
    with open(path, "w") as f:
        f.write("\n".join(out) + "\n")
    print(f"{len(out)} lines to {path}")


if __name__ == "__main__":
    main(sys.argv[1])
