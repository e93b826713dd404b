"""gpt-oss's harmony replies (weft/agents/harmony.py): analysis as reasoning, final as content,
messages to functions as tool calls, whole and streamed; the grammar that holds calls, forced
calls, a JSON answer and a thinking budget to the format, on a vocabulary with harmony's tokens;
and a chat through `LLM.chat` on a tiny model whose template writes harmony. The vocabulary is the
tests' byte-level BPE with harmony's tokens added as special tokens."""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import pytest
from test_agents import SCHEMAS, TOOLS, force_prefix

from weft import LLM, SamplingParams
from weft.agents.chat_tools import AgentFormats
from weft.agents.harmony import HarmonyStream, harmony_message
from weft.agents.reply import ForcedCall, plan_reply
from weft.agents.tool_formats import FORMATS, ToolSpec
from weft.structured.llguidance_backend import LLGuidanceBackend
from weft.tokenizer import Tokenizer

SPECIALS = ["<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|constrain|>", "<|return|>", "<|call|>"]
# a harmony template (the layout of gpt-oss's, written here): the reply opens after <|start|>assistant
TEMPLATE = (
    "{%- for m in messages -%}"
    "{%- if m.role == 'assistant' -%}<|start|>assistant<|channel|>final<|message|>{{ m.content }}<|end|>"
    "{%- elif m.role == 'tool' -%}<|start|>functions.{{ m.name }} to=assistant<|channel|>commentary"
    "<|message|>{{ m.content }}<|end|>"
    "{%- else -%}<|start|>{{ m.role }}<|message|>{{ m.content }}<|end|>{%- endif -%}"
    "{%- endfor -%}"
    "{%- if tools -%}<|start|>developer<|message|># Tools\n{{ tools | tojson }}<|end|>{%- endif -%}"
    "{%- if add_generation_prompt -%}<|start|>assistant{%- endif -%}"
)
ANALYSIS = "<|channel|>analysis<|message|>The user wants the time.<|end|><|start|>assistant"
TIME_CALL = '<|channel|>commentary to=functions.get_time <|constrain|>json<|message|>{"utc": true}'
FINAL = "<|channel|>final<|message|>It is noon."


@pytest.mark.parametrize(
    "text,reasoning,content,calls",
    [
        (ANALYSIS + FINAL, "The user wants the time.", "It is noon.", []),
        (FINAL, None, "It is noon.", []),
        (
            ANALYSIS + TIME_CALL + "<|call|>",
            "The user wants the time.",
            None,
            [("get_time", '{"utc": true}')],
        ),
        (TIME_CALL, None, None, [("get_time", '{"utc": true}')]),  # (<|call|>, a stop token, left out)
        (  # the older header: no <|constrain|>, the recipient before the channel's type
            '<|channel|>commentary to=functions.get_weather json<|message|>{"city": "Oslo", "days": 2}',
            None,
            None,
            [("get_weather", '{"city": "Oslo", "days": 2}')],
        ),
        (  # a preamble the user sees, then the call
            "<|channel|>commentary<|message|>Checking.<|end|><|start|>assistant" + TIME_CALL,
            None,
            "Checking.",
            [("get_time", '{"utc": true}')],
        ),
        ('<|channel|>commentary to=functions.get_time <|constrain|>json<|message|>{"utc": tr', None, "", []),
        ("No header at all.", None, "No header at all.", []),
    ],
)
def test_a_reply_reads_as_reasoning_content_and_calls(text, reasoning, content, calls):
    message = harmony_message(text)
    assert (message.reasoning_content, message.content) == (reasoning, content)
    assert [(c.name, c.arguments) for c in message.tool_calls] == calls
    stream = HarmonyStream()  # the same reply streamed a few characters at a time
    deltas = [d for i in range(0, len(text), 3) for d in stream.feed(text[i : i + 3], i + 3 >= len(text))]
    streamed = {key: "".join(d.get(key, "") for d in deltas) for key in ("reasoning_content", "content")}
    assert streamed == {"reasoning_content": reasoning or "", "content": content or ""}
    names = [c["function"]["name"] for d in deltas for c in d.get("tool_calls", []) if "id" in c]
    args = "".join(c["function"].get("arguments", "") for d in deltas for c in d.get("tool_calls", []))
    if calls:
        assert names == [name for name, _ in calls] and args.strip() == "".join(a for _, a in calls)
    else:  # (a stream announces a call once its header is read, as for every format; cut short, the
        # whole reading leaves it out)
        assert names == (["get_time"] if "to=functions" in text else [])


def harmony_tokenizer_dir(out: Path) -> Path:
    """The tests' byte-level BPE with harmony's tokens added and the template above."""
    from checkpoints import train_tiny_tokenizer
    from tokenizers import AddedToken

    raw = train_tiny_tokenizer()
    raw.add_special_tokens([AddedToken(s, special=True) for s in SPECIALS])
    out.mkdir(parents=True, exist_ok=True)
    raw.save(str(out / "tokenizer.json"))
    config = {"bos_token": None, "eos_token": "<|return|>", "chat_template": TEMPLATE}
    (out / "tokenizer_config.json").write_text(json.dumps(config))
    return out


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory) -> Path:
    return harmony_tokenizer_dir(tmp_path_factory.mktemp("harmony-tokenizer"))


def accepts(tokenizer: Tokenizer, constraint: dict, text: str) -> tuple[bool, bool]:
    backend = LLGuidanceBackend(
        tokenizer.tokenizer.to_str(), tokenizer.vocab_size, [tokenizer.eos_token_id or 0]
    )
    matcher = backend.new_matcher(backend.compile(SamplingParams(**constraint).structured))
    accepted = all(matcher.consume([t]) for t in tokenizer.encode(text, add_special_tokens=False))
    return accepted, accepted and bool(matcher.matcher.is_accepting())


def test_the_grammar_writes_harmony(tokenizer_dir):
    """Under "auto": an analysis message, then the final answer or one call in the model's own
    header (the function one of the tools, its arguments under its schema); forced: the call only;
    a JSON answer after final; a thinking budget ends the analysis; the template is detected."""
    tokenizer = Tokenizer.from_dir(tokenizer_dir)
    formats = AgentFormats.of(TEMPLATE)
    assert formats.tool_calls is FORMATS["harmony"] and formats.reasoning is not None
    tools = [ToolSpec.of(t) for t in TOOLS]
    specials = tokenizer.added_tokens
    plan = lambda **kw: plan_reply(  # noqa: E731
        tool_format=formats.tool_calls, reasoning=formats.reasoning, added_tokens=specials, **kw
    )
    auto = plan(constraint={}, tools=tools)
    assert auto.harmony and accepts(tokenizer, auto.constraint, ANALYSIS + FINAL) == (True, True)
    assert accepts(tokenizer, auto.constraint, ANALYSIS + TIME_CALL + "<|call|>") == (True, True)
    wrong = TIME_CALL.replace("get_time", "get_tim")
    assert accepts(tokenizer, auto.constraint, wrong) == (False, False)
    assert accepts(tokenizer, auto.constraint, TIME_CALL.replace("true", '"yes"')) == (False, False)
    assert accepts(tokenizer, auto.constraint, '{"utc": true}') == (False, False)  # not its format
    forced = plan(constraint={"json_schema": {}}, forced=ForcedCall(None), forced_tools=tools)
    assert accepts(tokenizer, forced.constraint, ANALYSIS + TIME_CALL + "<|call|>") == (True, True)
    assert accepts(tokenizer, forced.constraint, FINAL) == (False, False)
    schema = {"type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"]}
    answer = plan(constraint={"json_schema": schema})
    assert accepts(tokenizer, answer.constraint, ANALYSIS + '<|channel|>final<|message|>{"x": 1}') == (
        True,
        True,
    )
    assert accepts(tokenizer, answer.constraint, FINAL) == (False, False)
    budget = plan(constraint={}, thinking_budget=2)
    thinking = "<|channel|>analysis<|message|>" + " word" * 5
    assert accepts(tokenizer, budget.constraint, thinking) == (False, False)
    assert plan(constraint={}).constraint == {}  # nothing to hold: no grammar


def test_a_harmony_chat_calls_a_tool(tokenizer_dir, tmp_path):
    """A tiny random model whose template writes harmony: a named tool's call comes back as that
    tool's call with valid arguments; a final answer as content without control-token text."""
    from checkpoints import build_chat_checkpoint

    out = build_chat_checkpoint(tmp_path / "model", tokenizer_dir)
    llm = LLM(str(out), max_model_len=1024, show_progress=False)
    messages = [{"role": "user", "content": "What time is it?"}]
    named = {"type": "function", "function": {"name": "get_time"}}
    skip_analysis = force_prefix(llm.tokenizer.encode("<|channel|>commentary", add_special_tokens=False))
    params = SamplingParams(
        max_tokens=60, seed=0, logits_processors=[skip_analysis]
    )  # (random: it would muse)
    (reply,) = llm.chat(messages, params, tools=TOOLS, tool_choice=named)
    (completion,) = reply.outputs
    assert completion.message is not None and [c.name for c in completion.message.tool_calls] == ["get_time"]
    jsonschema.validate(json.loads(completion.message.tool_calls[0].arguments), SCHEMAS["get_time"])
    opener = llm.tokenizer.encode(FINAL, add_special_tokens=False)
    params = SamplingParams(max_tokens=len(opener) + 4, seed=0, logits_processors=[force_prefix(opener)])
    (reply,) = llm.chat(messages, params, tools=TOOLS)
    message = reply.outputs[0].message
    assert message is not None and not message.tool_calls and message.content.startswith("It is noon.")
    assert "<|" not in message.content
