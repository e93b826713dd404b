"""One chat reply's plan: how its output is constrained and how its text becomes a message.

`plan_reply` combines what a request asks for: a forced tool call (`tool_choice="required"` or a
named function: the reply is one JSON document), tool calls the model may choose to make (`"auto"`:
text, or calls in the model's own format), an answer constraint (`response_format`), and a reasoning
section before the answer that no constraint touches. The plan reads the reply back, whole
(`message`) or as it streams (`ReplyStream`), into OpenAI's assistant message: `content`,
`reasoning_content` and `tool_calls`.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from weft.agents.harmony import END, HarmonyStream, harmony_lark, harmony_message
from weft.agents.reasoning import ReasoningFormat, takes_budget
from weft.agents.tool_formats import CallShape, ToolCallFormat, ToolSpec
from weft.agents.tool_grammar import forced_call_lark, grammar_text, lark_json, tool_call_lark
from weft.agents.tool_reader import ToolCallStream, final_calls
from weft.outputs import AssistantMessage, ToolCall, new_call_id
from weft.schema_objects import JsonSchemaMode, apply_mode


@dataclass(frozen=True, slots=True)
class ForcedCall:
    """A reply that is one call's JSON: the named function's arguments, or (function None) for
    "required" `{"name": ..., "parameters": {...}}` naming one of the tools."""

    function: str | None

    def read(self, text: str, short_ids: bool = False) -> ToolCall | None:
        try:
            document = json.loads(text)
        except json.JSONDecodeError:  # cut short (max_tokens): the text stays content
            return None
        if self.function is not None:
            return ToolCall(self.function, json.dumps(document), new_call_id(short_ids))
        return ToolCall(document["name"], json.dumps(document["parameters"]), new_call_id(short_ids))


@dataclass(frozen=True, slots=True)
class ReplyPlan:
    constraint: dict[str, Any]  # SamplingParams' constraint fields ({} for none)
    tool_format: ToolCallFormat | None = None  # calls are read in this format ("auto")
    forced: ForcedCall | None = None
    reasoning: ReasoningFormat | None = None
    inside: bool = False  # the reply starts inside the reasoning section
    short_ids: bool = False  # tool call ids of 9 letters and digits (the format's templates ask it)
    tools: tuple[ToolSpec, ...] = ()  # the tools its calls may name (their parameters' types)
    harmony: bool = False  # the reply is harmony messages (gpt-oss: weft/agents/harmony.py)

    @property
    def reads_special_tokens(self) -> bool:
        """Whether the reply's text must keep special tokens (markers the reader looks for)."""
        return self.tool_format is not None or self.reasoning is not None or self.harmony

    def message(self, text: str, finished: bool = True) -> AssistantMessage:
        """The message of a reply; `finished` False: one cut short, whose calls are not read."""
        if self.harmony:
            return harmony_message(text, self.tools)
        reasoning, rest = self._split(text)
        if self.forced is not None:
            call = self.forced.read(rest, self.short_ids) if finished else None
            return AssistantMessage(None if call else rest, reasoning, [call] if call else [])
        if self.tool_format is not None:
            content, calls = final_calls(self.tool_format, rest, self.tools)
            return AssistantMessage(content, reasoning, calls)
        return AssistantMessage(rest, reasoning)

    def _split(self, text: str) -> tuple[str | None, str]:
        if self.reasoning is None:
            return None, text
        reasoning, rest, _ = self.reasoning.split(text, self.inside)
        return reasoning, rest

    def stream(self) -> ReplyStream:
        return ReplyStream(self)


class ReplyStream:
    """A growing reply -> chat deltas: `reasoning_content`, then `content`, then `tool_calls`
    (a forced call is sent whole when the reply finishes)."""

    def __init__(self, plan: ReplyPlan) -> None:
        self.plan = plan
        self.harmony = HarmonyStream() if plan.harmony else None
        self.plain = (
            plan.reasoning is None and plan.forced is None and plan.tool_format is None and not plan.harmony
        )
        self.text = ""  # the reply so far, kept only where it is read as a whole (not plain)
        self.reasoning_sent = 0
        self.content_sent = 0  # characters of the answer sent, where no tool calls are read
        self.calls = ToolCallStream(plan.tool_format, plan.tools) if plan.tool_format is not None else None
        self.sent_calls = False  # whether any tool_calls delta was sent

    def feed(self, new_text: str, finished: bool) -> list[dict[str, Any]]:
        """The deltas for `new_text`, what the reply added since the last call."""
        plan = self.plan
        if self.plain:
            return [{"content": new_text}] if new_text else []  # plain text: passed straight on
        if self.harmony is not None:
            said = self.harmony.feed(new_text, finished)
            self.sent_calls = self.sent_calls or any("tool_calls" in d for d in said)
            return said
        self.text += new_text
        rest = self.text
        deltas: list[dict[str, Any]] = []
        if plan.reasoning is not None:
            reasoning, rest, held = plan.reasoning.split(self.text, plan.inside, finished)
            if reasoning is not None and len(reasoning) - held > self.reasoning_sent:
                deltas.append({"reasoning_content": reasoning[self.reasoning_sent : len(reasoning) - held]})
                self.reasoning_sent = len(reasoning) - held
        if plan.forced is not None:
            return deltas + (self._forced(rest) if finished else [])
        content, calls = self.calls.update(rest, finished) if self.calls else (rest[self.content_sent :], [])
        self.content_sent = len(rest)
        if content:
            deltas.append({"content": content})
        if calls:
            self.sent_calls = True
            deltas.append({"tool_calls": calls})
        return deltas

    def _forced(self, rest: str) -> list[dict[str, Any]]:
        message = self.plan.message(self.text)
        if message.tool_calls:
            self.sent_calls = True
            return [{"tool_calls": [{"index": i, **c.to_openai()} for i, c in enumerate(message.tool_calls)]}]
        return [{"content": rest}] if rest else []


def forced_call(
    tools: Sequence[ToolSpec], function: str | None, mode: JsonSchemaMode
) -> tuple[dict[str, Any], ForcedCall]:
    """The constraint of a reply that must call `function` (None: any of `tools`, "required")."""
    if function is not None:
        tool = next((t for t in tools if t.name == function), None)
        if tool is None:
            raise ValueError(f"tool_choice names {function!r}, which is not among the tools")
        return {
            "json_schema": tool.arguments_schema(mode),
            "json_schema_mode": JsonSchemaMode.OPEN,
        }, ForcedCall(function)
    options = [
        {
            "type": "object",
            "properties": {"name": {"const": t.name}, "parameters": t.arguments_schema(mode)},
            "required": ["name", "parameters"],
            "additionalProperties": False,
        }
        for t in tools
    ]
    return {"json_schema": {"anyOf": options}, "json_schema_mode": JsonSchemaMode.OPEN}, ForcedCall(None)


def plan_reply(
    *,
    constraint: dict[str, Any],
    forced: ForcedCall | None = None,
    tools: Sequence[ToolSpec] = (),
    tool_format: ToolCallFormat | None = None,
    reasoning: ReasoningFormat | None = None,
    prompt: str = "",
    added_tokens: Mapping[str, int] | None = None,
    mode: JsonSchemaMode = JsonSchemaMode.CLOSED,
    parallel_tool_calls: bool = True,
    forced_tools: Sequence[ToolSpec] = (),
    thinking_budget: int | None = None,
) -> ReplyPlan:
    """The plan of a reply to `prompt` (its rendered text). `constraint`: the answer's constraint
    from response_format (or the forced call's); `tools` with `tool_format`: calls the model may
    choose to make ("auto"); `forced_tools` with `tool_format`: the tools a forced call chooses
    from, written in the format (else the forced call is its bare JSON); `thinking_budget`: the
    most tokens of the reasoning section, where its end marker is one token (`takes_budget`).
    Raises ValueError for a combination weft cannot constrain."""
    specials = added_tokens or {}
    if (tool_format is not None and tool_format.shape == CallShape.HARMONY) or (
        reasoning is not None and reasoning.name == "harmony"
    ):
        chosen = tools if forced is None else ()
        return _harmony_plan(constraint, forced, chosen, forced_tools, specials, mode, thinking_budget)
    budget = thinking_budget if reasoning is not None and takes_budget(reasoning, specials) else None
    inside = reasoning is not None and reasoning.opens_inside(prompt)
    short_ids = tool_format is not None and tool_format.short_ids
    if forced is not None and tool_format is not None and forced_tools:
        top = "answer" if reasoning is not None else "start"
        parallel = parallel_tool_calls and forced.function is None
        rules = forced_call_lark(tool_format, forced_tools, specials, parallel=parallel, mode=mode, start=top)
        if reasoning is not None:
            rules += reasoning.lark(inside, top, specials, budget=budget)
        grammar = {"grammar": grammar_text(rules), "grammar_syntax": "lark"}
        return ReplyPlan(grammar, tool_format, None, reasoning, inside, short_ids, tuple(forced_tools))
    auto = bool(tools) and tool_format is not None and forced is None
    if not auto and (reasoning is None or (not constraint and budget is None)):
        return ReplyPlan(
            constraint, tool_format if auto else None, forced, reasoning, inside, short_ids, tuple(tools)
        )
    answer = _answer_rule(constraint, mode) if constraint else None
    top = "answer" if reasoning is not None else "start"
    if auto:
        assert tool_format is not None
        rules = tool_call_lark(
            tool_format, tools, specials, parallel=parallel_tool_calls, mode=mode, answer=answer, start=top
        )
    else:
        rules = f"{top}: {answer}\n" if answer else f"{top}: ANSWER_TEXT\nANSWER_TEXT: /(.|\\n)*/\n"
    if reasoning is not None:
        rules += reasoning.lark(inside, top, specials, budget=budget)
    grammar = {"grammar": grammar_text(rules), "grammar_syntax": "lark"}
    return ReplyPlan(
        grammar, tool_format if auto else None, forced, reasoning, inside, short_ids, tuple(tools)
    )


def _harmony_plan(
    constraint: dict[str, Any],
    forced: ForcedCall | None,
    tools: Sequence[ToolSpec],
    forced_tools: Sequence[ToolSpec],
    specials: Mapping[str, int],
    mode: JsonSchemaMode,
    thinking_budget: int | None,
) -> ReplyPlan:
    """A gpt-oss reply: harmony messages, constrained where there are tools, a forced call, an
    answer's schema or a thinking budget (weft/agents/harmony.py)."""
    calls = tuple(forced_tools if forced is not None else tools)
    answer = _answer_rule(constraint, mode) if constraint and forced is None else None
    budget = thinking_budget if END in specials else None
    if not calls and answer is None and budget is None:
        return ReplyPlan({}, tools=calls, harmony=True)
    rules = harmony_lark(
        specials, tools=calls, forced=forced is not None, answer=answer, mode=mode, budget=budget
    )
    return ReplyPlan({"grammar": grammar_text(rules), "grammar_syntax": "lark"}, tools=calls, harmony=True)


def _answer_rule(constraint: dict[str, Any], mode: JsonSchemaMode) -> str:
    """A JSON constraint as a Lark rule body, to combine with tool calls or a reasoning section."""
    if constraint.get("json_object"):
        return lark_json({"type": "object"})
    schema = constraint.get("json_schema")
    if schema is None:
        kinds = ", ".join(k for k in constraint if k != "json_schema_mode")
        raise ValueError(
            f"a {kinds} constraint cannot be combined with tool calls or a reasoning section; "
            "use a JSON schema (response_format) there"
        )
    if isinstance(schema, str):
        schema = json.loads(schema)
    return lark_json(apply_mode(schema, constraint.get("json_schema_mode", mode)))
