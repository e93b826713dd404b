"""gpt-oss's harmony format: reasoning, answer and tool calls as channels of one reply.

After the template's `<|start|>assistant` a reply is a run of messages, each

    <|channel|>CHANNEL[ to=RECIPIENT][ <|constrain|>TYPE]<|message|>BODY

ended by `<|end|>` (the next then opens with `<|start|>assistant`), `<|call|>` (a tool call: the
turn ends) or `<|return|>` (the final answer: the turn ends). The analysis channel is the reasoning,
final the answer, a message to `functions.NAME` a call of that tool with its body as the JSON
arguments; commentary with no recipient (a preamble the user sees) is content too. The turn's last
token is a stop token, so a finished reply's text may lack it.

The grammar (`harmony_lark`) writes the same layout: an optional analysis message, then the final
answer (free text, or JSON under the request's schema) or a call in the model's own header, the
function named from the tools and its arguments under that tool's schema.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from weft.agents.tool_formats import ToolSpec
from weft.agents.tool_grammar import lark_json, lark_literal
from weft.agents.tool_reader import marker_start_at_end
from weft.outputs import AssistantMessage, ToolCall, new_call_id
from weft.schema_objects import JsonSchemaMode

START, CHANNEL, MESSAGE, CONSTRAIN = "<|start|>", "<|channel|>", "<|message|>", "<|constrain|>"
END, CALL, RETURN = "<|end|>", "<|call|>", "<|return|>"
NEXT = f"{START}assistant"  # what opens each message after the first
FUNCTIONS = "functions."


def is_harmony(chat_template: str | None) -> bool:
    """Whether a chat template writes harmony messages."""
    return bool(chat_template) and all(m in chat_template for m in (CHANNEL, MESSAGE, START))  # type: ignore[operator]


@dataclass(frozen=True, slots=True)
class HarmonyMessage:
    channel: str
    recipient: str | None  # e.g. "functions.get_weather"
    body: str
    ended: bool  # its end token was written (or the finished reply ended with it)

    @property
    def function(self) -> str | None:
        """The tool a message to `functions.NAME` calls."""
        if self.recipient is None or not self.recipient.startswith(FUNCTIONS):
            return None
        return self.recipient[len(FUNCTIONS) :]


def read_messages(text: str, finished: bool = True) -> tuple[list[HarmonyMessage], int]:
    """The messages of a reply (or of its start), and how many characters at its end are held back
    (they may be the start of a marker). Text outside any header (a model that left the format) is
    read as a final message."""
    messages: list[HarmonyMessage] = []
    pos = 0
    while pos < len(text):
        if text.startswith(NEXT, pos):
            pos += len(NEXT)
            continue
        if not text.startswith(CHANNEL, pos):
            if not finished and (CHANNEL.startswith(text[pos:]) or NEXT.startswith(text[pos:])):
                return messages, len(text) - pos
            (rest, ended), held = _body(text, pos, finished)
            messages.append(HarmonyMessage("final", None, rest, ended))
            return messages, held
        header_end = text.find(MESSAGE, pos)
        if header_end < 0:
            return messages, 0 if finished else len(text) - pos
        channel, recipient = _header(text[pos + len(CHANNEL) : header_end])
        (body, ended), held = _body(text, header_end + len(MESSAGE), finished)
        messages.append(HarmonyMessage(channel, recipient, body, ended))
        if not ended:
            return messages, held
        pos = header_end + len(MESSAGE) + len(body)
        pos += next((len(m) for m in (END, CALL, RETURN) if text.startswith(m, pos)), 0)
    return messages, 0


def _header(header: str) -> tuple[str, str | None]:
    """(channel, recipient) of `analysis`, `commentary to=functions.f <|constrain|>json`, ..."""
    words = header.replace(CONSTRAIN, " ").split()
    recipient = next((w[3:] for w in words if w.startswith("to=")), None)
    return (words[0] if words else ""), recipient


def _body(text: str, start: int, finished: bool) -> tuple[tuple[str, bool], int]:
    """((the body from `start` to its end token, whether it ended), characters held back)."""
    ends = [at for at in (text.find(m, start) for m in (END, CALL, RETURN)) if at >= 0]
    if ends:
        return (text[start : min(ends)], True), 0
    body = text[start:]
    if finished:
        return (body, True), 0  # (its end token was a stop token, not in the text)
    held = max(marker_start_at_end(body, m) for m in (END, CALL, RETURN))
    return (body[: len(body) - held], False), held


def harmony_message(text: str, tools: Sequence[ToolSpec] = ()) -> AssistantMessage:
    """A finished reply as OpenAI's assistant message: analysis as `reasoning_content`, final and
    preambles as `content`, messages to functions as `tool_calls` (a call's arguments that are not
    JSON, cut short, stay out)."""
    messages, _ = read_messages(text)
    reasoning = [m.body for m in messages if m.channel == "analysis" and m.function is None]
    content = [m.body for m in messages if m.channel != "analysis" and m.function is None]
    calls = [ToolCall(m.function, m.body.strip()) for m in messages if m.function and _is_json(m.body)]
    answer = "".join(content)
    return AssistantMessage(
        answer if answer or not calls else None, "".join(reasoning) if reasoning else None, calls
    )


def _is_json(text: str) -> bool:
    try:
        json.loads(text)
    except json.JSONDecodeError:
        return False
    return True


class HarmonyStream:
    """A growing harmony reply -> chat deltas: `reasoning_content`, `content`, and each call's id and
    name once its header is read, then its arguments as they are written."""

    def __init__(self) -> None:
        self.text = ""
        self.sent = {"reasoning_content": 0, "content": 0}
        self.calls: list[ToolCall] = []

    def feed(self, new_text: str, finished: bool) -> list[dict[str, Any]]:
        self.text += new_text
        messages, _ = read_messages(self.text, finished)
        parts = {"reasoning_content": "", "content": ""}
        deltas: list[dict[str, Any]] = []
        calls = []
        for m in messages:
            if m.function is not None:
                calls.append(m)
            else:
                parts["reasoning_content" if m.channel == "analysis" else "content"] += m.body
        for key, text in parts.items():
            if len(text) > self.sent[key]:
                deltas.append({key: text[self.sent[key] :]})
                self.sent[key] = len(text)
        tool_deltas = []
        for index, m in enumerate(calls):
            if index == len(self.calls):
                self.calls.append(ToolCall(m.function or "", "", new_call_id()))
                tool_deltas.append({"index": index, **self.calls[index].to_openai()})
            call = self.calls[index]
            if len(m.body) > len(call.arguments):
                tool_deltas.append({"index": index, "function": {"arguments": m.body[len(call.arguments) :]}})
                call.arguments = m.body
        return deltas + ([{"tool_calls": tool_deltas}] if tool_deltas else [])


def harmony_lark(
    special_tokens: Mapping[str, int],
    *,
    tools: Sequence[ToolSpec] = (),
    forced: bool = False,
    answer: str | None = None,
    mode: JsonSchemaMode = JsonSchemaMode.CLOSED,
    budget: int | None = None,
) -> str:
    """The Lark rules (`start`) of a harmony reply: an optional analysis message (at most `budget`
    tokens of it where given), then the final answer (free text, or `answer`, a rule body such as
    `%json {...}`) or, with `tools`, one call in the model's own header; with `forced`, the call
    only."""
    lit = lambda text: lark_literal(text, special_tokens)  # noqa: E731
    for marker in (CHANNEL, MESSAGE, END, START):
        if marker not in special_tokens:
            raise ValueError(f"a harmony grammar needs {marker} as one token of the vocabulary")
    body = f"h_body[max_tokens={budget}]: /(.|\\n)*/" if budget is not None else "h_body: /(.|\\n)*/"
    rules = [
        f'h_analysis: {lit(CHANNEL)} "analysis" {lit(MESSAGE)} h_body {lit(END)} {lit(NEXT)}',
        body,
        f'h_final: {lit(CHANNEL)} "final" {lit(MESSAGE)} {answer or "H_TEXT"}',
        "H_TEXT: /(.|\\n)*/",
    ]
    ends = [] if forced else ["h_final"]
    for i, tool in enumerate(tools):
        header = f"{CHANNEL}commentary to={FUNCTIONS}{tool.name} {CONSTRAIN}json{MESSAGE}"
        rules.append(f"h_args_{i}: {lark_json(tool.arguments_schema(mode))}")
        call_end = f" {lit(CALL)}" if CALL in special_tokens else ""
        rules.append(f"h_call_{i}: {lit(header)} h_args_{i}{call_end}")
        ends.append(f"h_call_{i}")
    if not ends:
        raise ValueError("a forced harmony call needs at least one tool")
    rules.insert(0, f"start: h_analysis? ({' | '.join(ends)})")
    return "\n".join(rules) + "\n"
