"""What structured output does for a real model's answers: `weft bench quality`.

Two tasks on a trained instruct model (the default model, SmolLM2-135M-Instruct, unless --model),
greedy, each run with and without weft's constraint:

1. Extraction: a Pydantic model (name, age, city) from each of 30 sentences written for this
   benchmark (names, ages and cities in varied positions and phrasings). Unconstrained, the first
   JSON object in the reply is parsed; constrained, the reply is held to the model's JSON Schema.
   Reported: the share of replies that validate, and the share of fields right (name and city
   compared case-insensitively, age as an integer).
2. Tool calls under `tool_choice="auto"`: 20 questions a weather tool answers and 10 it does not,
   with the tools and one worked example in the system message (as `weft demo`). Reported: the
   share of tool questions answered by a call that parses and validates against the tool's JSON
   Schema (a strict Pydantic model of it; and names the right city), and the share of other
   questions answered without a call. Without the constraint: the same prompt and the same
   reader, the call's text free.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, ValidationError

SENTENCES = [
    ("Maria Lopez is 34 years old and lives in Barcelona.", "Maria Lopez", 34, "Barcelona"),
    ("Last week, 27-year-old Tom Becker moved from Hamburg to Lisbon.", "Tom Becker", 27, "Lisbon"),
    ("Aiko Tanaka, 41, teaches music in Osaka.", "Aiko Tanaka", 41, "Osaka"),
    ("The new mayor of Denver is James Carter, who is 58.", "James Carter", 58, "Denver"),
    ("Priya Sharma (29) works as a nurse in Mumbai.", "Priya Sharma", 29, "Mumbai"),
    ("In Toronto, 63-year-old Robert Chen opened a bakery.", "Robert Chen", 63, "Toronto"),
    ("Lena Fischer turned 22 last month; she studies in Vienna.", "Lena Fischer", 22, "Vienna"),
    ("Carlos Mendes, a 45-year-old engineer, lives in Porto.", "Carlos Mendes", 45, "Porto"),
    ("Emma Wilson from Dublin is 31.", "Emma Wilson", 31, "Dublin"),
    ("At 70, Hassan Ali still runs his shop in Cairo.", "Hassan Ali", 70, "Cairo"),
    ("Sofia Rossi, 19, is a student in Rome.", "Sofia Rossi", 19, "Rome"),
    ("Our guide in Oslo was Erik Hansen, aged 52.", "Erik Hansen", 52, "Oslo"),
    ("Nina Petrova lives in Prague and is 38 years old.", "Nina Petrova", 38, "Prague"),
    ("David Kim, 26, codes for a startup in Seoul.", "David Kim", 26, "Seoul"),
    ("The 47-year-old chef Pierre Dubois works in Lyon.", "Pierre Dubois", 47, "Lyon"),
    ("Grace Okafor is a 33-year-old lawyer based in Lagos.", "Grace Okafor", 33, "Lagos"),
    ("Miguel Torres (61) retired to Seville.", "Miguel Torres", 61, "Seville"),
    ("Anna Kowalski, who lives in Warsaw, just turned 40.", "Anna Kowalski", 40, "Warsaw"),
    ("Liam O'Brien is 24 and plays football in Glasgow.", "Liam O'Brien", 24, "Glasgow"),
    ("In Stockholm lives Ingrid Berg, 55.", "Ingrid Berg", 55, "Stockholm"),
    ("Raj Patel, 36, is a doctor in Chicago.", "Raj Patel", 36, "Chicago"),
    ("Chloe Martin, aged 28, paints murals in Paris.", "Chloe Martin", 28, "Paris"),
    ("Yusuf Demir is 50 and drives a taxi in Istanbul.", "Yusuf Demir", 50, "Istanbul"),
    ("Hannah Schmidt, 35, moved to Munich for work.", "Hannah Schmidt", 35, "Munich"),
    ("The violinist Mei Lin, 43, performs in Shanghai.", "Mei Lin", 43, "Shanghai"),
    ("Jack Thompson lives in Sydney; he is 39.", "Jack Thompson", 39, "Sydney"),
    ("Fatima Zahra, 21, studies medicine in Casablanca.", "Fatima Zahra", 21, "Casablanca"),
    ("Oliver Brown, 67, grows roses in Bristol.", "Oliver Brown", 67, "Bristol"),
    ("Isabel Garcia is a 30-year-old architect in Madrid.", "Isabel Garcia", 30, "Madrid"),
    ("Kofi Mensah, 44, runs a radio station in Accra.", "Kofi Mensah", 44, "Accra"),
]
TOOL_QUESTIONS = [
    ("Will I need an umbrella in London today?", "London"),
    ("What's the weather like in Paris right now?", "Paris"),
    ("Is it raining in Tokyo?", "Tokyo"),
    ("How cold is it in Moscow today?", "Moscow"),
    ("Is it sunny in Madrid?", "Madrid"),
    ("What is the temperature in Berlin?", "Berlin"),
    ("Should I wear a coat in Chicago today?", "Chicago"),
    ("Is it snowing in Helsinki?", "Helsinki"),
    ("How windy is it in Wellington right now?", "Wellington"),
    ("What's the forecast for Sydney today?", "Sydney"),
    ("Is it hot in Dubai today?", "Dubai"),
    ("Do I need sunglasses in Lisbon?", "Lisbon"),
    ("What is the weather in Toronto?", "Toronto"),
    ("Is it foggy in San Francisco this morning?", "San Francisco"),
    ("How humid is it in Singapore?", "Singapore"),
    ("Is there a storm in Miami?", "Miami"),
    ("What's the weather in Mexico City?", "Mexico City"),
    ("Is it cloudy in Dublin today?", "Dublin"),
    ("Can I go for a picnic in Vienna today, weather-wise?", "Vienna"),
    ("Tell me the current weather in Seoul.", "Seoul"),
]
OTHER_QUESTIONS = [
    "What is 2 + 2?",
    "Write a haiku about the sea.",
    "What is the capital of Japan?",
    "Translate 'thank you' into French.",
    "Name three primary colors.",
    "What is a prime number?",
    "How many days are in a week?",
    "Give me a synonym for happy.",
    "What does a cat say?",
    "Spell the word 'apple' backwards.",
]


class Person(BaseModel):
    name: str
    age: int
    city: str


class WeatherArguments(BaseModel):  # the get_weather tool's parameters (weft.demo.WEATHER), strictly
    model_config = ConfigDict(extra="forbid", strict=True)
    city: str


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="a checkpoint or GGUF file (default: the default model)")
    p.add_argument("--json", type=Path, default=None, help="also write the results to this JSON file")


ASK = "Extract the person's name, age and city as JSON with the keys name, age and city."


def extraction_prompt(sentence: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": f"{ASK}\n{sentence}"}]


def first_object(text: str) -> Any:
    """The first JSON object in a reply (None if there is none)."""
    decoder = json.JSONDecoder()
    for start in (i for i, c in enumerate(text) if c == "{"):
        try:
            return decoder.raw_decode(text[start:])[0]
        except json.JSONDecodeError:
            continue
    return None


def score_extraction(texts: list[str]) -> dict[str, float]:
    valid, right = 0, 0
    for text, (_, name, age, city) in zip(texts, SENTENCES, strict=True):
        try:
            person = Person.model_validate(first_object(text))
        except ValidationError:
            continue
        valid += 1
        right += person.name.strip().lower() == name.lower()
        right += person.age == age
        right += person.city.strip().lower() == city.lower()
    return {"valid": valid / len(SENTENCES), "fields": right / (3 * len(SENTENCES))}


def extraction(llm: Any, constrained: bool) -> dict[str, float]:
    from weft import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=80, json_schema=Person if constrained else None)
    start = time.perf_counter()
    outs = llm.chat([extraction_prompt(s) for s, *_ in SENTENCES], params, use_tqdm=False)
    result = score_extraction([o.outputs[0].text for o in outs])
    return {**result, "seconds": time.perf_counter() - start}


def tool_calls(llm: Any, constrained: bool) -> dict[str, float]:
    """Calls under "auto": with the constraint weft holds a call to the format once it starts;
    without it (`tool_choice="none"` for weft, the same prompt), the reply is read the same way."""
    from weft import SamplingParams
    from weft.agents.tool_formats import tool_format
    from weft.agents.tool_reader import final_calls
    from weft.demo import TOOL_EXAMPLE, TOOL_SYSTEM, WEATHER

    questions = [q for q, _ in TOOL_QUESTIONS] + OTHER_QUESTIONS
    conversations = [
        [{"role": "system", "content": TOOL_SYSTEM}, *TOOL_EXAMPLE, {"role": "user", "content": q}]
        for q in questions
    ]
    params = SamplingParams(temperature=0, max_tokens=60, skip_special_tokens=False)
    choice = "auto" if constrained else "none"
    start = time.perf_counter()
    outs = llm.chat(conversations, params, tools=[WEATHER], tool_choice=choice, tool_call_parser="hermes")
    seconds = time.perf_counter() - start
    hermes = tool_format("hermes")
    good, right, quiet = 0, 0, 0
    for i, out in enumerate(outs):
        _, calls = final_calls(hermes, out.outputs[0].text)
        if i >= len(TOOL_QUESTIONS):
            quiet += not calls
            continue
        if len(calls) != 1 or calls[0].name != "get_weather":
            continue
        try:
            arguments = WeatherArguments.model_validate_json(calls[0].arguments)
        except ValidationError:
            continue
        good += 1
        right += arguments.city.lower() == TOOL_QUESTIONS[i][1].lower()
    n = len(TOOL_QUESTIONS)
    return {
        "valid_calls": good / n,
        "right_city": right / n,
        "no_call": quiet / len(OTHER_QUESTIONS),
        "seconds": seconds,
    }


def run(args: argparse.Namespace) -> int:
    from weft import LLM
    from weft.engine.default_model import named_model

    model = str(named_model(args.model))
    llm = LLM(model, show_progress=False)
    print(f"weft bench quality: {model}; ISA path {llm.kernels['isa']} ({llm.kernels['cpu']})")
    results = {
        "extraction": {name: extraction(llm, name == "constrained") for name in ("free", "constrained")},
        "tool_calls": {name: tool_calls(llm, name == "constrained") for name in ("free", "constrained")},
    }
    print("\n| extraction (30 sentences) | replies that validate | fields right | seconds |")
    print("|---|---:|---:|---:|")
    for name, r in results["extraction"].items():
        print(f"| {name} | {r['valid']:.0%} | {r['fields']:.0%} | {r['seconds']:.1f} |")
    print(
        "\n| tool calls, auto (20 + 10 questions) | valid calls | right city | no call where none fits | s |"
    )
    print("|---|---:|---:|---:|---:|")
    for name, r in results["tool_calls"].items():
        shares = f"{r['valid_calls']:.0%} | {r['right_city']:.0%} | {r['no_call']:.0%}"
        print(f"| {name} | {shares} | {r['seconds']:.1f} |")
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))
    return 0
