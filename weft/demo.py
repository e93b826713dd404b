"""`weft demo`: what weft does, on the bundled model, offline, in a few seconds.

A free completion, a JSON Schema completion and a choice, all in one batch, then the engine stats.
"""

from __future__ import annotations

import json
import time

from weft.llm import LLM
from weft.params import SamplingParams

PROMPT = "ROMEO:"
SCENE_SCHEMA = {
    "type": "object",
    "properties": {
        "speaker": {"enum": ["ROMEO", "JULIET", "MERCUTIO", "NURSE", "FRIAR LAURENCE"]},
        "mood": {"enum": ["loving", "angry", "merry", "grieving"]},
        "line": {"type": "string", "maxLength": 60},
    },
    "required": ["speaker", "mood", "line"],
    "additionalProperties": False,
}


def run(model: str | None = None, seed: int = 7) -> int:
    llm = LLM(model)
    requests = [
        ("free text", PROMPT, SamplingParams(temperature=0.8, top_p=0.95, max_tokens=60, seed=seed)),
        (
            "JSON Schema",
            "A line from the play, as JSON:\n",
            SamplingParams(json_schema=SCENE_SCHEMA, temperature=0.8, max_tokens=120, seed=seed),
        ),
        (
            "choice",
            "Who loves Juliet?",
            SamplingParams(choice=["ROMEO", "TYBALT", "PARIS"], temperature=0.8, seed=seed),
        ),
    ]
    start = time.perf_counter()
    outputs = llm.generate([p for _, p, _ in requests], [s for _, _, s in requests], use_tqdm=False)
    elapsed = time.perf_counter() - start
    for (title, prompt, _), out in zip(requests, outputs, strict=True):
        completion = out.outputs[0]
        print(f"=== {title} ({len(completion.token_ids)} tokens, finish: {completion.finish_reason})")
        print(prompt + completion.text if title == "free text" else f"{prompt.strip()} -> {completion.text}")
        if title == "JSON Schema" and completion.finish_reason == "stop":
            print(f"    parses as JSON: {json.loads(completion.text) is not None}")
        print()
    stats = llm.stats()
    print(
        f"3 requests in one batch, {elapsed:.2f} s; {int(stats['num_forced_tokens'])} tokens forced by the "
        f"grammar without sampling, {int(stats['num_sampled_tokens'])} sampled"
    )
    return 0
