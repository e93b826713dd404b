"""`weft demo`: what weft does, offline, in a few seconds.

On the default model (SmolLM2-135M-Instruct, `scripts/install.sh` installs it): a chat answer, a
Pydantic model extracted from a sentence, a choice answered with the exact logprob of every
option, a tool call the model chooses to make under `tool_choice="auto"`, and the top-5 logprobs
of an answer, each with its time. On the bundled Shakespeare model (where the default one is not
installed, or `--model` names it): a free completion, a JSON Schema completion and a choice in one
batch.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path

from pydantic import BaseModel

from weft.engine.default_model import bundled_model_path, default_model_path
from weft.llm import LLM
from weft.params import SamplingParams


class Person(BaseModel):
    name: str
    age: int
    city: str


SENTENCE = "Last week, 27-year-old Tom Becker moved from Hamburg to Lisbon."
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the current weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
# The tools and the call format, in the system message (the model's own chat template has no tool
# section), and one worked example: a 135M model then calls when a tool answers, and only then.
TOOL_SYSTEM = (
    "You are an expert in composing functions. You have access to these tools:\n<tools>\n"
    + json.dumps([WEATHER["function"]])
    + "\n</tools>\nWhen a tool can answer, reply only with a call: <tool_call>\n"
    + '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>'
)
TOOL_EXAMPLE = [
    {"role": "user", "content": "What's the weather in Rome?"},
    {
        "role": "assistant",
        "content": '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call>',
    },
]


def run(model: str | None = None, seed: int = 7) -> int:
    path = Path(model) if model is not None else default_model_path()
    if path.resolve() == bundled_model_path().resolve():
        return _shakespeare(LLM(path), seed)
    start = time.perf_counter()
    llm = LLM(path)
    print(f"loaded {path.name} in {time.perf_counter() - start:.1f} s\n")
    for title, section in _sections(llm):
        start = time.perf_counter()
        lines = section()
        print(f"=== {title} ({time.perf_counter() - start:.2f} s)")
        print("\n".join(lines) + "\n")
    return 0


def _sections(llm: LLM) -> list[tuple[str, Callable[[], list[str]]]]:
    return [
        ("chat", lambda: _chat(llm)),
        ("a Pydantic model from a sentence", lambda: _extract(llm)),
        ("a choice, every option scored exactly", lambda: _choice(llm)),
        ('a tool call under tool_choice="auto"', lambda: _tool_call(llm)),
        ("top-5 logprobs of an answer", lambda: _logprobs(llm)),
    ]


def _chat(llm: LLM) -> list[str]:
    question = "Explain what a prime number is in one sentence."
    reply = llm.chat([{"role": "user", "content": question}], SamplingParams(temperature=0, max_tokens=40))
    return [f"user: {question}", f"assistant: {reply[0].outputs[0].text}"]


def _extract(llm: LLM) -> list[str]:
    message = {"role": "user", "content": f"Extract the person's name, age and city as JSON.\n{SENTENCE}"}
    params = SamplingParams(json_schema=Person, temperature=0, max_tokens=60)
    text = llm.chat([message], params)[0].outputs[0].text
    person = Person.model_validate_json(text)
    return [SENTENCE, f"-> {person!r} (validates)"]


def _choice(llm: LLM) -> list[str]:
    question = "Which planet is known as the Red Planet?"
    prompt = llm.render_chat([{"role": "user", "content": question}])
    scores = sorted(llm.score(prompt, ["Mars", "Venus", "Jupiter", "Saturn"]), key=lambda s: -s.logprob)
    options = ", ".join(f"{s.text} {s.logprob:.2f}" for s in scores)
    return [question, f"-> {scores[0].text} (total logprob of each option: {options})"]


def _tool_call(llm: LLM) -> list[str]:
    lines = []
    for question in ("Will I need an umbrella in London today?", "What is 2 + 2?"):
        asked = {"role": "user", "content": question}
        messages = [{"role": "system", "content": TOOL_SYSTEM}, *TOOL_EXAMPLE, asked]
        params = SamplingParams(temperature=0, max_tokens=40)
        out = llm.chat(messages, params, tools=[WEATHER], tool_choice="auto", tool_call_parser="hermes")
        message = out[0].outputs[0].message
        assert message is not None
        calls = [f"{c.name}({c.arguments})" for c in message.tool_calls]
        answer = f"calls {', '.join(calls)}" if calls else f"answers {message.content!r}"
        lines.append(f"{question} -> {answer}")
    return lines


def _logprobs(llm: LLM) -> list[str]:
    question = "What is the capital of Japan?"
    params = SamplingParams(temperature=0, max_tokens=12, logprobs=5)
    out = llm.chat([{"role": "user", "content": question}], params)[0].outputs[0]
    lines = [f"user: {question}", f"assistant: {out.text}"]
    for step in (out.logprobs or [])[:4]:
        top = ", ".join(f"{v.decoded_token!r} {v.logprob:.2f}" for v in step.values())
        lines.append(f"  {top}")
    return lines


# ---- the bundled model


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


def _shakespeare(llm: LLM, seed: int) -> int:
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
