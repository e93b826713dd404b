"""Tool calls under tool_choice="auto" in each model family's format, and reasoning kept apart:
formats told from the real chat templates, the grammar checked on real tokenizers, replies read
back whole and streamed, and tiny random models over real tokenizers pushed into a call."""

from __future__ import annotations

import functools
import json

import jsonschema
import pytest
import torch
from checkpoints import build_chat_checkpoint
from conftest import shared_data

from weft import LLM, SamplingParams
from weft.agents.chat_tools import AgentFormats
from weft.agents.reasoning import REASONING_FORMATS, ReasoningFormat
from weft.agents.reply import plan_reply
from weft.agents.tool_formats import FORMATS, ToolSpec, detect_tool_format
from weft.agents.tool_reader import ToolCallStream, final_calls, read_reply
from weft.structured.llguidance_backend import LLGuidanceBackend
from weft.tokenizer import Tokenizer

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The forecast for a city.",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"enum": ["Paris", "Oslo", "Lima"], "description": "The city."},
                "days": {"type": "integer", "minimum": 1, "maximum": 7, "description": "Days ahead."},
            },
            "required": ["city", "days"],
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "description": "The time now.",
        "parameters": {
            "type": "object",
            "properties": {"utc": {"type": "boolean", "description": "In UTC."}},
            "required": ["utc"],
        },
    },
}
TOOLS = [WEATHER, TIME]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
CALL = '{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}'
CALL_ARGS = '{"city": "Paris", "days": 3}'
TIME_CALL = '{"name": "get_time", "arguments": {"utc": true}}'

TEMPLATES = {
    "NousResearch-Hermes-2-Pro-Llama-3-8B-tool_use.jinja": "hermes",
    "NousResearch-Hermes-3-Llama-3.1-8B-tool_use.jinja": "hermes",
    "Qwen-Qwen2.5-7B-Instruct.jinja": "hermes",
    "meta-llama-Llama-3.1-8B-Instruct.jinja": "llama3_json",
    "meta-llama-Llama-3.2-3B-Instruct.jinja": "llama3_json",
    "meta-llama-Llama-3.3-70B-Instruct.jinja": "llama3_json",
    "mistralai-Mistral-Nemo-Instruct-2407.jinja": "mistral",
    "meetkai-functionary-medium-v3.1.jinja": "functionary_v3_1",
    "fireworks-ai-llama-3-firefunction-v2.jinja": "firefunction_v2",
    "deepseek-ai-DeepSeek-R1-Distill-Qwen-32B.jinja": None,
    "google-gemma-2-2b-it.jinja": None,
    "microsoft-Phi-3.5-mini-instruct.jinja": None,
    "CohereForAI-c4ai-command-r7b-12-2024-tool_use.jinja": None,
}


@pytest.mark.parametrize("template,expected", TEMPLATES.items())
def test_the_format_is_told_from_the_real_template(template, expected):
    text = shared_data(f"chat_templates/{template}").read_text()
    fmt = detect_tool_format(text)
    assert (fmt.name if fmt else None) == expected


def test_a_thinking_template_is_detected_and_opens_the_reply_inside():
    text = shared_data("chat_templates/deepseek-ai-DeepSeek-R1-Distill-Qwen-32B.jinja").read_text()
    formats = AgentFormats.of(text)
    assert formats.reasoning is REASONING_FORMATS["deepseek_r1"]
    assert formats.reasoning.opens_inside("<｜User｜>hi<｜Assistant｜><think>\n")
    assert not formats.reasoning.opens_inside("<think>\n\n</think>\n\n")  # enable_thinking: false
    assert AgentFormats.of(text, reasoning_parser="none").reasoning is None


# ---- reading replies: each format, whole and streamed ----

REPLIES = {
    "hermes": (
        f"Let me check.<tool_call>\n{CALL}\n</tool_call>\n<tool_call>\n"
        '{"name": "get_time", "arguments": {"utc": true}}\n</tool_call>'
    ),
    "mistral": f"[TOOL_CALLS][{CALL}, {TIME_CALL}]",
    "llama3_json": (
        '{"name": "get_weather", "parameters": {"city": "Paris", "days": 3}}; '
        '{"name": "get_time", "parameters": {"utc": true}}'
    ),
    "functionary_v3_1": (
        'Let me check.<function=get_weather>{"city": "Paris", "days": 3}</function>'
        '<function=get_time>{"utc": true}</function>'
    ),
    "firefunction_v2": f"Let me check. functools[{CALL}, {TIME_CALL}]",
    "granite": f"Let me check.<|tool_call|>[{CALL}, {TIME_CALL}]",
    "phi4_mini": f"Let me check.<|tool_call|>[{CALL}, {TIME_CALL}]<|/tool_call|>",
    "qwen3_coder": (
        "Let me check.<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
        "<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>\n<tool_call>\n"
        "<function=get_time>\n<parameter=utc>\ntrue\n</parameter>\n</function>\n</tool_call>"
    ),
}
SPECS = [ToolSpec.of(t) for t in TOOLS]


@pytest.mark.parametrize("name", REPLIES)
def test_calls_are_read_back_whole_and_streamed(name):
    fmt, text = FORMATS[name], REPLIES[name]
    content, calls = final_calls(fmt, text, SPECS)
    assert [c.name for c in calls] == ["get_weather", "get_time"]
    assert [json.loads(c.arguments) for c in calls] == [{"city": "Paris", "days": 3}, {"utc": True}]
    assert (content or "").strip() in ("", "Let me check.")
    stream, streamed, names, args = ToolCallStream(fmt, SPECS), "", {}, {}
    for end in range(1, len(text) + 1):  # one character at a time: every split point
        new, deltas = stream.update(text[:end], finished=end == len(text))
        streamed += new
        for d in deltas:
            if "id" in d:
                names[d["index"]] = d["function"]["name"]
            args[d["index"]] = args.get(d["index"], "") + d["function"]["arguments"]
    assert streamed == (content or "") and "<" not in streamed
    assert names == {0: "get_weather", 1: "get_time"}
    assert [args[0], args[1]] == [c.arguments for c in calls]


def test_text_that_only_starts_like_a_trigger_is_content():
    fmt = FORMATS["hermes"]
    assert read_reply(fmt, "a <tool").held == len("<tool")
    assert final_calls(fmt, "a <tools> b") == ("a <tools> b", [])
    cut = f"x<tool_call>\n{CALL[:30]}"  # cut short by max_tokens: no call, the text is content
    assert final_calls(fmt, cut) == (cut, [])


def test_reasoning_is_split_from_the_answer_whole_and_streamed():
    fmt = REASONING_FORMATS["deepseek_r1"]
    assert fmt.split("Hmm, 2+2.</think>\n\n4", inside=True) == ("Hmm, 2+2.", "4", 0)
    assert fmt.split("<think>a</think>b", inside=False) == ("a", "b", 0)
    assert fmt.split("plain", inside=False) == (None, "plain", 0)
    assert fmt.split("still thinking </thi", inside=True, finished=False) == ("still thinking </thi", "", 5)
    plan = plan_reply(constraint={}, reasoning=fmt, prompt="<think>\n")
    stream, text = plan.stream(), "Hmm, 2+2.</think>\n\nIt is 4."
    got: dict[str, str] = {}
    for end in range(1, len(text) + 1):
        for delta in stream.feed(text[end - 1 : end], finished=end == len(text)):
            for key, value in delta.items():
                got[key] = got.get(key, "") + value
    assert got == {"reasoning_content": "Hmm, 2+2.", "content": "It is 4."}


# ---- the grammar, on real tokenizers ----


@functools.cache
def _tokenizer(name: str) -> Tokenizer:
    return Tokenizer.from_dir(shared_data(f"tokenizers/{name}"))


@functools.cache
def _backend(tokenizer_name: str) -> LLGuidanceBackend:
    tok = _tokenizer(tokenizer_name)
    return LLGuidanceBackend(tok.tokenizer.to_str(), tok.vocab_size, [tok.eos_token_id or 0])


def _matcher_accepts(tokenizer_name: str, plan_constraint: dict, text: str) -> tuple[bool, bool]:
    tok, backend = _tokenizer(tokenizer_name), _backend(tokenizer_name)
    matcher = backend.new_matcher(backend.compile(SamplingParams(**plan_constraint).structured))
    accepted = all(matcher.consume([t]) for t in tok.encode(text, add_special_tokens=False))
    return accepted, accepted and bool(matcher.matcher.is_accepting())


GRAMMAR_CASES = [  # tokenizer, format, reply, accepted as a prefix, complete
    ("qwen2.5", "hermes", "Just text, no call.", True, True),  # <tool_call> is one token here
    ("qwen2.5", "hermes", REPLIES["hermes"], True, True),
    ("qwen2.5", "hermes", '<tool_call>\n{"name": "get_wind"', False, False),
    ("qwen2.5", "hermes", '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"', False, False),
    ("llama3", "hermes", REPLIES["hermes"], True, True),  # <tool_call> is text here: a lazy trigger
    ("llama3", "hermes", 'x<tool_call>\n{"name": "get_time", "arguments": {"utc": 1', False, False),
    ("llama3", "llama3_json", "Paris is sunny.", True, True),
    ("llama3", "llama3_json", REPLIES["llama3_json"], True, True),
    ("llama3", "llama3_json", "{ not a call", False, False),
    ("mistral", "mistral", REPLIES["mistral"], True, True),
    ("mistral", "mistral", '[TOOL_CALLS][{"name": "nope', False, False),
    ("llama3", "functionary_v3_1", REPLIES["functionary_v3_1"], True, True),
    ("llama3", "functionary_v3_1", "<function=get_tim>", False, False),
    ("llama3", "firefunction_v2", REPLIES["firefunction_v2"], True, True),
    ("llama3", "granite", REPLIES["granite"], True, True),
    ("llama3", "granite", '<|tool_call|>[{"name": "get_time", "arguments": {"utc": 1', False, False),
    ("llama3", "phi4_mini", REPLIES["phi4_mini"], True, True),
    ("llama3", "phi4_mini", REPLIES["phi4_mini"].removesuffix("<|/tool_call|>"), True, False),  # unclosed
    ("llama3", "hermes", f"<tool_call>\n{CALL}\n</tool_call>", True, True),
    ("qwen2.5", "qwen3_coder", "Just text, no call.", True, True),
    ("qwen2.5", "qwen3_coder", REPLIES["qwen3_coder"], True, True),
    ("qwen2.5", "qwen3_coder", "<tool_call>\n<function=get_weather>\n<parameter=city>\nRome", False, False),
    (
        "qwen2.5",
        "qwen3_coder",
        "<tool_call>\n<function=get_weather>\n<parameter=days>",
        False,
        False,
    ),  # city first
    ("qwen2.5", "qwen3_coder", "<tool_call>\n<function=get_time>\n<parameter=utc>\nyes", False, False),
    ("qwen2.5", "qwen3_coder", "<tool_call>\n<function=get_time>\n</function>", False, False),  # utc required
    ("qwen2.5", "qwen3_coder", '<tool_call>\n{"name": "get_time"', False, False),  # Hermes' JSON call
]


@pytest.mark.parametrize("tokenizer,fmt,text,accepted,complete", GRAMMAR_CASES)
def test_the_grammar_allows_text_and_exactly_the_valid_calls(tokenizer, fmt, text, accepted, complete):
    tools = [ToolSpec.of(t) for t in TOOLS]
    specials = _tokenizer(tokenizer).added_tokens
    plan = plan_reply(constraint={}, tools=tools, tool_format=FORMATS[fmt], added_tokens=specials)
    assert _matcher_accepts(tokenizer, plan.constraint, text) == (accepted, complete)


def test_one_call_only_without_parallel_tool_calls():
    tools = [ToolSpec.of(t) for t in TOOLS]
    specials = _tokenizer("qwen2.5").added_tokens
    plan = plan_reply(
        constraint={},
        tools=tools,
        tool_format=FORMATS["hermes"],
        added_tokens=specials,
        parallel_tool_calls=False,
    )
    assert _matcher_accepts("qwen2.5", plan.constraint, REPLIES["hermes"]) == (False, False)
    assert _matcher_accepts("qwen2.5", plan.constraint, f"<tool_call>\n{CALL}\n</tool_call>") == (True, True)


FORCED_CASES = [  # tokenizer, format, tool_choice's function (None: "required"), reply, accepted, complete
    ("qwen2.5", "hermes", "get_weather", f"<tool_call>\n{CALL}\n</tool_call>", True, True),
    ("qwen2.5", "hermes", "get_weather", CALL_ARGS, False, False),  # the bare arguments: not its format
    ("qwen2.5", "hermes", "get_weather", f"<tool_call>\n{TIME_CALL}\n</tool_call>", False, False),
    ("qwen2.5", "hermes", "get_weather", "Sure. <tool_call>", False, False),  # no text before the call
    ("qwen2.5", "hermes", None, REPLIES["hermes"], False, False),  # "required": no text before
    ("qwen2.5", "hermes", None, REPLIES["hermes"].removeprefix("Let me check."), True, True),  # two calls
    ("qwen2.5", "hermes", None, f"<tool_call>\n{TIME_CALL}\n</tool_call>", True, True),
    ("llama3", "llama3_json", "get_weather", CALL.replace('"arguments"', '"parameters"'), True, True),
    ("mistral", "mistral", None, REPLIES["mistral"], True, True),
    ("qwen2.5", "qwen3_coder", None, REPLIES["qwen3_coder"].removeprefix("Let me check."), True, True),
    (
        "qwen2.5",
        "qwen3_coder",
        "get_time",
        REPLIES["qwen3_coder"].split("</tool_call>")[1][1:] + "</tool_call>",
        True,
        True,
    ),
    ("qwen2.5", "qwen3_coder", "get_weather", "<tool_call>\n<function=get_time>", False, False),
]


@pytest.mark.parametrize("tokenizer,fmt,function,text,accepted,complete", FORCED_CASES)
def test_a_forced_call_is_written_in_the_models_own_format(
    tokenizer, fmt, function, text, accepted, complete
):
    """tool_choice "required" or a named function: the opener, the call's name (fixed where named),
    the arguments under the tool's schema and the closer, as the template taught the model; the
    reply reads back as the call."""
    from weft.agents.reply import ForcedCall

    tools = [ToolSpec.of(t) for t in TOOLS]
    chosen = [t for t in tools if function in (None, t.name)]
    specials = _tokenizer(tokenizer).added_tokens
    plan = plan_reply(
        constraint={"json_schema": {}},  # (the bare call's, which the format replaces)
        forced=ForcedCall(function),
        forced_tools=chosen,
        tool_format=FORMATS[fmt],
        added_tokens=specials,
    )
    assert _matcher_accepts(tokenizer, plan.constraint, text) == (accepted, complete)
    if complete:
        calls = plan.message(text).tool_calls
        assert calls and all(function in (None, c.name) for c in calls)


SCHEMA = {"type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"]}


@pytest.mark.parametrize(
    "reasoning,prompt,text,accepted,complete",
    [
        # </think> is text in this vocabulary: the section ends at its first occurrence
        (REASONING_FORMATS["deepseek_r1"], "<think>\n", 'I think {"y": "</think>\n\n{"x": 1}', True, True),
        (REASONING_FORMATS["deepseek_r1"], "<think>\n", "thinking, no answer yet", True, False),
        (REASONING_FORMATS["deepseek_r1"], "<think>\n", "done</think>\nnot JSON", False, False),
        (REASONING_FORMATS["deepseek_r1"], "", '<think>a</think>{"x": 1}', True, True),
        (REASONING_FORMATS["deepseek_r1"], "", '{"x": 1}', True, True),
        # markers that are single tokens (stand-ins for R1's <think> tokens): other added tokens may
        # occur inside the section
        (
            ReasoningFormat("t", "<tool_call>", "</tool_call>"),
            "<tool_call>",
            'a <|im_start|></tool_call>{"x": 2}',
            True,
            True,
        ),
        (ReasoningFormat("t", "<tool_call>", "</tool_call>"), "<tool_call>", "a</tool_call>x", False, False),
    ],
)
def test_a_json_answer_holds_only_after_the_reasoning(reasoning, prompt, text, accepted, complete):
    specials = _tokenizer("qwen2.5").added_tokens
    plan = plan_reply(
        constraint={"json_schema": SCHEMA}, reasoning=reasoning, prompt=prompt, added_tokens=specials
    )
    assert _matcher_accepts("qwen2.5", plan.constraint, text) == (accepted, complete)


@pytest.mark.parametrize("budget", [0, 3, 8])
def test_a_thinking_budget_ends_the_section_in_time(budget):
    """With a budget of n tokens the section holds at most n tokens of thinking, then its end marker
    is the only next token (single-token markers: stand-ins for Qwen3's); the answer after it is
    free (or under its constraint); a budget has nothing to hold where the marker is text."""
    reasoning, specials = (
        ReasoningFormat("t", "<tool_call>", "</tool_call>"),
        _tokenizer("qwen2.5").added_tokens,
    )
    tok = _tokenizer("qwen2.5")
    plan = plan_reply(
        constraint={},
        reasoning=reasoning,
        prompt="<tool_call>",
        added_tokens=specials,
        thinking_budget=budget,
    )
    thinking = tok.decode(
        tok.encode(" one two three four five six seven eight nine ten", add_special_tokens=False)[:budget]
    )
    assert _matcher_accepts("qwen2.5", plan.constraint, f"{thinking}</tool_call>Sure.") == (True, True)
    longer = tok.decode(
        tok.encode(" one two three four five six seven eight nine ten", add_special_tokens=False)[
            : budget + 1
        ]
    )
    assert _matcher_accepts("qwen2.5", plan.constraint, f"{longer}</tool_call>Sure.") == (False, False)
    json_plan = plan_reply(
        constraint={"json_schema": SCHEMA}, reasoning=reasoning, prompt="<tool_call>", added_tokens=specials,
        thinking_budget=budget,
    )  # fmt: skip
    assert _matcher_accepts("qwen2.5", json_plan.constraint, f'{thinking}</tool_call>{{"x": 1}}') == (
        True,
        True,
    )
    text_marker = plan_reply(constraint={}, reasoning=REASONING_FORMATS["deepseek_r1"], prompt="<think>\n",
                             added_tokens=specials, thinking_budget=budget)  # fmt: skip
    assert text_marker.constraint == {}  # (</think> is text in this vocabulary: no budget)


# ---- tiny models over real tokenizers, pushed into a call ----


def force_prefix(token_ids: list[int]):
    """A logits processor that makes the reply start with `token_ids` (then leaves it alone)."""

    def force(output: list[int], logits: torch.Tensor) -> torch.Tensor:
        if len(output) < len(token_ids):
            forced = torch.full_like(logits, float("-inf"))
            forced[token_ids[len(output)]] = 0.0
            return forced
        return logits

    return force


@pytest.fixture(scope="module")
def chat_models(tmp_path_factory):
    cache: dict[str, LLM] = {}

    def get(tokenizer: str) -> LLM:
        if tokenizer not in cache:
            out = tmp_path_factory.mktemp(f"chat-{tokenizer}")
            build_chat_checkpoint(out, shared_data(f"tokenizers/{tokenizer}"))
            cache[tokenizer] = LLM(str(out), max_model_len=2048)
        return cache[tokenizer]

    return get


FAMILIES = [  # tokenizer, chat template, the text that opens the reply
    ("qwen2.5", "Qwen-Qwen2.5-7B-Instruct.jinja", "Sure. <tool_call>"),
    ("llama3", "NousResearch-Hermes-3-Llama-3.1-8B-tool_use.jinja", "Sure. <tool_call>"),
    ("llama3", "meta-llama-Llama-3.1-8B-Instruct.jinja", '{"name": '),
    ("mistral", "mistralai-Mistral-Nemo-Instruct-2407.jinja", "[TOOL_CALLS]["),
    ("llama3", "meetkai-functionary-medium-v3.1.jinja", "Sure. <function="),
    ("llama3", "fireworks-ai-llama-3-firefunction-v2.jinja", " functools["),
    ("qwen2.5", "QWEN3_CODER_TEMPLATE", "Sure. <tool_call>"),
]


@pytest.mark.parametrize("tokenizer,template,opening", FAMILIES)
def test_every_call_a_model_starts_parses_and_validates(chat_models, tokenizer, template, opening):
    llm = chat_models(tokenizer)
    if template == "QWEN3_CODER_TEMPLATE":
        chat_template = QWEN3_CODER_TEMPLATE
    else:
        chat_template = shared_data(f"chat_templates/{template}").read_text()
    opener = llm.tokenizer.encode(opening, add_special_tokens=False)
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    for seed in range(2):
        params = SamplingParams(max_tokens=200, seed=seed, logits_processors=[force_prefix(opener)])
        # firefunction's template reads the tools as `functions` (JSON) and today's date
        kwargs = {"functions": json.dumps([t["function"] for t in TOOLS]), "datetime": "2026-11-25"}
        (out,) = llm.chat(
            messages, params, chat_template=chat_template, tools=TOOLS, chat_template_kwargs=kwargs
        )
        (c,) = out.outputs
        assert c.finish_reason == "stop", c.text
        message = c.message
        assert message is not None and message.tool_calls, c.text
        for call in message.tool_calls:
            jsonschema.validate(json.loads(call.arguments), SCHEMAS[call.name])
        expected = "Sure." if opening.startswith("Sure.") else None
        assert (message.content.strip() if message.content else None) == expected


def test_without_a_push_the_reply_is_text_and_tools_can_be_hidden(chat_models):
    llm = chat_models("qwen2.5")
    messages = [{"role": "user", "content": "Hi"}]
    bias_away = lambda ids, logits: logits.index_fill_(0, torch.tensor([151657]), float("-inf"))  # noqa: E731
    (out,) = llm.chat(
        messages, SamplingParams(max_tokens=8, seed=1, logits_processors=[bias_away]), tools=TOOLS
    )
    assert out.outputs[0].message.tool_calls == [] and out.outputs[0].message.content == out.outputs[0].text
    (out,) = llm.chat(messages, SamplingParams(max_tokens=8, seed=1), tools=TOOLS, tool_choice="none")
    assert out.outputs[0].message is None and "get_weather" not in out.prompt


def test_a_required_call_from_python(chat_models):
    llm = chat_models("qwen2.5")
    messages = [{"role": "user", "content": "Time?"}]
    named = {"type": "function", "function": {"name": "get_time"}}
    for choice in ("required", named):
        (out,) = llm.chat(messages, SamplingParams(max_tokens=100, seed=0), tools=TOOLS, tool_choice=choice)
        calls = out.outputs[0].message.tool_calls
        assert calls and (choice == "required" or [c.name for c in calls] == ["get_time"])  # named: one
        for call in calls:  # ("required" may call several, as parallel_tool_calls allows)
            jsonschema.validate(json.loads(call.arguments), SCHEMAS[call.name])
    with pytest.raises(ValueError, match="not among the tools"):
        llm.chat(messages, tools=TOOLS, tool_choice={"type": "function", "function": {"name": "nope"}})


def test_reasoning_is_kept_apart_and_the_schema_holds_for_the_answer(chat_models):
    llm = chat_models("qwen2.5")
    template = shared_data("chat_templates/deepseek-ai-DeepSeek-R1-Distill-Qwen-32B.jinja").read_text()
    thought = llm.tokenizer.encode("Let me think.</think>", add_special_tokens=False)
    params = SamplingParams(
        max_tokens=60, seed=0, json_schema=SCHEMA, logits_processors=[force_prefix(thought)]
    )
    (out,) = llm.chat([{"role": "user", "content": "x?"}], params, chat_template=template)
    message = out.outputs[0].message
    assert out.prompt.endswith("<think>\n") and message.reasoning_content == "Let me think."
    jsonschema.validate(json.loads(message.content), SCHEMA)


# ---- through the server and the official openai client ----


@pytest.fixture(scope="module")
def qwen_server(qwen_chat):
    return qwen_chat[1]


def test_auto_tool_calls_through_the_server_whole_and_streamed(qwen_server):
    client = qwen_server.client()
    request = {
        "model": "chat",
        "messages": [{"role": "user", "content": "Weather in Paris?"}],
        "tools": TOOLS,
        "logit_bias": {"151657": 100},  # <tool_call>: the model starts a call at once
        "parallel_tool_calls": False,
        "max_tokens": 200,
        "seed": 3,
    }
    whole = client.chat.completions.create(**request)
    (choice,) = whole.choices
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])
    chunks = list(client.chat.completions.create(**request, stream=True))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    calls = [t for d in deltas for t in d.tool_calls or []]
    assert calls[0].id and calls[0].type == "function" and calls[0].function.name == call.function.name
    assert "".join(t.function.arguments or "" for t in calls) == call.function.arguments  # same seed
    assert all(t.index == 0 for t in calls) and not any(d.content for d in deltas)
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_text_before_no_call_is_content_through_the_server(qwen_server):
    response = qwen_server.client().chat.completions.create(
        model="chat",
        messages=[{"role": "user", "content": "Hi"}],
        tools=TOOLS,
        tool_choice="auto",
        logit_bias={"151657": -100},
        max_tokens=10,
        seed=0,
    )
    (choice,) = response.choices
    assert choice.finish_reason == "length" and choice.message.tool_calls is None and choice.message.content


def test_call_arguments_reach_a_template_as_the_object_it_writes_with_tojson():
    from weft.tokenizer import render_chat_template

    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": CALL_ARGS}}
    messages = [
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
    ]
    qwen = shared_data("chat_templates/Qwen-Qwen2.5-7B-Instruct.jinja").read_text()
    assert f'"arguments": {CALL_ARGS}' in render_chat_template(qwen, messages)  # not a quoted string
    functionary = shared_data("chat_templates/meetkai-functionary-medium-v3.1.jinja").read_text()
    rendered = render_chat_template(functionary, messages, bos_token="<|begin_of_text|>")
    assert f"<function=get_weather>{CALL_ARGS}</function>" in rendered


def test_mistral_call_ids_are_the_nine_characters_its_template_takes():
    from weft.tokenizer import render_chat_template

    fmt = FORMATS["mistral"]
    _, (call,) = final_calls(fmt, f"[TOOL_CALLS][{CALL}]")
    assert len(call.id) == 9 and call.id.isalnum()
    plan = plan_reply(constraint={}, tools=[ToolSpec.of(WEATHER)], tool_format=fmt)
    (streamed,) = [d for d in plan.stream().feed(f"[TOOL_CALLS][{CALL}]", True) if "tool_calls" in d]
    assert len(streamed["tool_calls"][0]["id"]) == 9
    messages = [
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": None, "tool_calls": [call.to_openai()]},
        {"role": "tool", "tool_call_id": call.id, "content": "sunny"},
    ]
    nemo = shared_data("chat_templates/mistralai-Mistral-Nemo-Instruct-2407.jinja").read_text()
    assert f'"id": "{call.id}"' in render_chat_template(nemo, messages, bos_token="<s>", eos_token="</s>")


# ---- Qwen3-Coder's calls: a tag per call and per parameter, values as plain text ----

# A template that teaches the call shape as Qwen3-Coder's does (its tools in XML, the example call,
# the calls of earlier turns written from their arguments with `items`); written here, not copied.
QWEN3_CODER_TEMPLATE = """
{%- if tools %}<|im_start|>system
You have access to the following functions:

<tools>{% for tool in tools %}
<function><name>{{ tool.function.name }}</name></function>{% endfor %}
</tools>

If you choose to call a function ONLY reply in the following format with NO suffix:

<tool_call>
<function=example_function_name>
<parameter=example_parameter_1>
value_1
</parameter>
</function>
</tool_call><|im_end|>
{% endif %}
{%- for message in messages %}
{%- if message.tool_calls %}<|im_start|>assistant
{%- for call in message.tool_calls %}
<tool_call>
<function={{ call.function.name }}>
{% for key, value in call.function.arguments|items %}<parameter={{ key }}>
{{ value }}
</parameter>
{% endfor %}</function>
</tool_call>{% endfor %}<|im_end|>
{% elif message.role == "tool" %}<|im_start|>user
<tool_response>
{{ message.content }}
</tool_response><|im_end|>
{% else %}<|im_start|>{{ message.role }}
{{ message.content }}<|im_end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""

WRITE_FILE = {
    "type": "function",
    "function": {
        "name": "write_file",
        "parameters": {
            "type": "object",
            "properties": {
                "path": {"type": "string"},
                "content": {"type": "string"},
                "mode": {"type": "integer"},
            },
            "required": ["path", "content"],
        },
    },
}


# Granite 3.x's templates tell the model to "respond only with <|tool_call|> followed by a JSON list"
# and write earlier calls so; written here, not copied
GRANITE_TEMPLATE = """
{%- if tools %}<|start_of_role|>available_tools<|end_of_role|>{{ tools | tojson }}<|end_of_text|>
{% endif %}
{%- for message in messages %}<|start_of_role|>{{ message.role }}<|end_of_role|>
{%- if message.tool_calls %}<|tool_call|>{{ message.tool_calls | map(attribute="function") | list | tojson }}
{%- else %}{{ message.content }}{% endif %}<|end_of_text|>
{% endfor %}
{%- if add_generation_prompt %}<|start_of_role|>assistant<|end_of_role|>{% endif %}"""


def test_granite_calls_are_detected_and_read_back_as_its_template_writes_them():
    from weft.tokenizer import render_chat_template

    assert detect_tool_format(GRANITE_TEMPLATE).name == "granite"
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": CALL_ARGS}}
    messages = [
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": None, "tool_calls": [call]},
    ]
    rendered = render_chat_template(GRANITE_TEMPLATE, messages, tools=[WEATHER], add_generation_prompt=False)
    reply = rendered[rendered.index("<|tool_call|>") : rendered.rindex("<|end_of_text|>")]
    _, (back,) = final_calls(FORMATS["granite"], reply, SPECS)
    assert back.name == "get_weather" and json.loads(back.arguments) == json.loads(CALL_ARGS)


# Phi-4-mini's template reads the tools from the system message and writes each message's content
# after its role's token; written here, not copied
PHI4_MINI_TEMPLATE = """
{%- for message in messages %}<|{{ message['role'] }}|>{{ message['content'] }}
{%- if message['role'] == 'system' and message['tools'] is defined and message['tools'] is not none %}
<|tool|>{{ message['tools'] }}<|/tool|>{% endif %}<|end|>{% endfor %}
{%- if add_generation_prompt %}<|assistant|>{% endif %}"""


def test_phi4_mini_gets_its_tools_in_the_system_message_and_its_format():
    from weft.tokenizer import render_chat_template

    assert detect_tool_format(PHI4_MINI_TEMPLATE).name == "phi4_mini"
    tools_text = json.dumps([WEATHER["function"], TIME["function"]], ensure_ascii=False)
    user = {"role": "user", "content": "Weather?"}
    alone = render_chat_template(PHI4_MINI_TEMPLATE, [user], tools=TOOLS)
    assert alone == f"<|system|><|tool|>{tools_text}<|/tool|><|end|><|user|>Weather?<|end|><|assistant|>"
    system = {"role": "system", "content": "Be brief."}
    with_system = render_chat_template(PHI4_MINI_TEMPLATE, [system, user], tools=TOOLS)
    assert with_system.startswith(f"<|system|>Be brief.<|tool|>{tools_text}<|/tool|><|end|><|user|>")
    assert "<|tool|>" not in render_chat_template(PHI4_MINI_TEMPLATE, [system, user])  # no tools: none
    hermes = shared_data("chat_templates/Qwen-Qwen2.5-7B-Instruct.jinja").read_text()
    assert "Be brief." in render_chat_template(hermes, [system, user], tools=TOOLS)  # others: as given


def test_qwen3_coder_calls_are_told_apart_from_hermes_and_written_back_by_its_template():
    from weft.tokenizer import render_chat_template

    assert detect_tool_format(QWEN3_CODER_TEMPLATE).name == "qwen3_coder"
    arguments = '{"path": "a.py", "content": "x = 1\\nprint(x)"}'
    call = {"id": "call_1", "type": "function", "function": {"name": "write_file", "arguments": arguments}}
    messages = [
        {"role": "user", "content": "Write it."},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": "done"},
    ]
    rendered = render_chat_template(QWEN3_CODER_TEMPLATE, messages, tools=[WRITE_FILE])
    turn = rendered[rendered.index("<|im_start|>assistant") :]
    reply = turn[turn.index("<tool_call>") : turn.index("</tool_call>") + len("</tool_call>")]
    assert "<parameter=content>\nx = 1\nprint(x)\n</parameter>" in reply  # the text itself, not JSON
    _, (back,) = final_calls(FORMATS["qwen3_coder"], reply, [ToolSpec.of(WRITE_FILE)])
    assert back.name == "write_file" and json.loads(back.arguments) == json.loads(arguments)


def test_qwen3_coder_string_values_are_plain_text_and_the_rest_json():
    """A string parameter is its text up to the first closing tag, whatever it looks like ("007"
    stays a string, lines and all); an integer is JSON under its schema; optional ones may be left
    out, and the parameters come in the schema's order."""
    specs = [ToolSpec.of(WRITE_FILE)]
    plan = plan_reply(
        constraint={},
        tools=specs,
        tool_format=FORMATS["qwen3_coder"],
        added_tokens=_tokenizer("qwen2.5").added_tokens,
    )
    head = "<tool_call>\n<function=write_file>\n<parameter=path>\n007\n</parameter>\n"
    body = "<parameter=content>\n<b>\n  {1}\n</parameter>\n"
    whole = head + body + "<parameter=mode>\n420\n</parameter>\n</function>\n</tool_call>"
    assert _matcher_accepts("qwen2.5", plan.constraint, whole) == (True, True)
    assert _matcher_accepts("qwen2.5", plan.constraint, head + body + "</function>\n</tool_call>") == (
        True,
        True,
    )
    assert _matcher_accepts("qwen2.5", plan.constraint, head + body + "<parameter=mode>\nx") == (False, False)
    ends_early = (
        head + "<parameter=content>\na\n</parameter>\nb\n</parameter>\n"
    )  # the first closing tag ends it
    assert _matcher_accepts("qwen2.5", plan.constraint, ends_early) == (False, False)
    _, (call,) = final_calls(FORMATS["qwen3_coder"], whole, specs)
    assert json.loads(call.arguments) == {"path": "007", "content": "<b>\n  {1}", "mode": 420}


def test_instructors_tools_mode_gets_the_fields_it_asked_for(qwen_server):
    """instructor's TOOLS mode as it calls the server (instructor 1.17 itself needs jiter < 0.15,
    which the locked openai client's >= 0.16 excludes): the Pydantic model's schema as the one tool,
    `tool_choice` naming it, the arguments parsed into the model. The call is written in the
    template's own shape (`<tool_call>{"name": "Person", "arguments": ...}`), so the model's
    arguments are its fields, not the function's name."""
    from pydantic import BaseModel

    class Person(BaseModel):
        name: str
        age: int

    tool = {"type": "function", "function": {"name": "Person", "parameters": Person.model_json_schema()}}
    response = qwen_server.client().chat.completions.create(
        model="chat",
        messages=[{"role": "user", "content": "Extract: Ada is 36."}],
        tools=[tool],
        tool_choice={"type": "function", "function": {"name": "Person"}},
        max_tokens=60,
        seed=0,
    )
    (choice,) = response.choices
    (call,) = choice.message.tool_calls
    assert call.function.name == "Person" and choice.finish_reason in ("tool_calls", "stop")
    person = Person.model_validate_json(call.function.arguments)
    assert set(json.loads(call.function.arguments)) == {"name", "age"} and isinstance(person.age, int)
