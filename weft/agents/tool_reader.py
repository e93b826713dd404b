"""Reading tool calls back out of a reply's text, whole or as it streams.

The grammar (weft/agents/tool_grammar.py) lays calls out exactly as the format says, so the reader
is a cursor over that layout, not a tolerant parser: text up to the trigger is content; then each
call's name, then its arguments (a JSON object, scanned by depth so that its end is known without
parsing), then a separator or the end. On a reply still being written it returns what is known so
far; `ToolCallStream` turns successive readings into OpenAI's streaming deltas.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from weft.agents.tool_formats import (
    XML_PARAMETER_CLOSE,
    CallShape,
    ToolCallFormat,
    ToolSpec,
    is_text,
)
from weft.outputs import ToolCall, new_call_id


@dataclass(slots=True)
class PartialCall:
    name: str | None  # None until the name is written whole
    arguments: str  # the arguments' text so far
    complete: bool


@dataclass(slots=True)
class Reading:
    content: str  # the text before the calls (all of it where there are none)
    calls: list[PartialCall]
    held: int = 0  # characters at the end of `content` that may be the start of the trigger


def read_reply(fmt: ToolCallFormat, text: str, tools: Sequence[ToolSpec] = ()) -> Reading:
    """The content and the calls of `text`, a reply (or the start of one) in `fmt`. `tools` say
    which parameters are strings, where the format writes values as plain text (`CallShape.XML`)."""
    at = _calls_start(fmt, text)
    if at is None:
        return Reading(text, [], _held(fmt, text))
    pos = at + len(fmt.trigger)
    lead = (fmt.opener + fmt.name_lead)[len(fmt.trigger) :]  # the first call's text before its name
    calls: list[PartialCall] = []
    while text.startswith(lead, pos):
        call, pos = _read_call(fmt, text, pos + len(lead), tools)
        calls.append(call)
        if not call.complete or not text.startswith(fmt.separator, pos):
            break
        pos += len(fmt.separator)
        lead = fmt.name_lead
    return Reading(text[:at], calls)


def _calls_start(fmt: ToolCallFormat, text: str) -> int | None:
    if fmt.at_start:
        stripped = text.removeprefix("<|python_tag|>")
        return len(text) - len(stripped) if stripped.startswith(fmt.trigger) else None
    at = text.find(fmt.trigger)
    return None if at < 0 else at


def _held(fmt: ToolCallFormat, text: str) -> int:
    """How many trailing characters of `text` could still grow into the trigger."""
    if fmt.at_start:
        return len(text) if fmt.trigger.startswith(text) or "<|python_tag|>".startswith(text) else 0
    return marker_start_at_end(text, fmt.trigger)


def marker_start_at_end(text: str, marker: str) -> int:
    """The length of the longest end of `text` that is a proper start of `marker` (0 if none): the
    characters a stream holds back until they cannot become the marker."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:n]):
            return n
    return 0


def _read_call(
    fmt: ToolCallFormat, text: str, pos: int, tools: Sequence[ToolSpec] = ()
) -> tuple[PartialCall, int]:
    """A call from `pos`, just after the text that precedes its name."""
    if fmt.shape == CallShape.XML:
        return _read_xml_call(text, pos, tools)
    if fmt.shape == CallShape.TAG:
        end = text.find(">", pos)
        if end < 0:
            return PartialCall(None, "", False), len(text)
        name, pos = text[pos:end], end + 1
    else:
        name_end = _string_end(text, pos)
        if name_end is None:
            return PartialCall(None, "", False), len(text)
        name = json.loads(text[pos:name_end])
        pos = name_end + len(f', "{fmt.arguments_key}": ')
        if pos > len(text):
            return PartialCall(name, "", False), len(text)
    args_end = _value_end(text, pos)
    if args_end is None:
        return PartialCall(name, text[pos:], False), len(text)
    end = args_end
    complete = text.startswith(fmt.call_suffix, end)
    return PartialCall(name, text[pos:end], complete), end + len(fmt.call_suffix) if complete else len(text)


def _read_xml_call(text: str, pos: int, tools: Sequence[ToolSpec]) -> tuple[PartialCall, int]:
    """A call in the XML shape from just after `<function=`: its name, then each whole parameter,
    its arguments written as the JSON object they make (growing by whole parameters as it streams)."""
    end = text.find(">\n", pos)
    if end < 0:
        return PartialCall(None, "", False), len(text)
    name, pos = text[pos:end], end + 2
    properties = next((t.parameters.get("properties") or {} for t in tools if t.name == name), {})
    members: list[str] = []
    while text.startswith(_PARAMETER, pos):
        key_end = text.find(">\n", pos)
        value_end = text.find(XML_PARAMETER_CLOSE, key_end + 2) if key_end >= 0 else -1
        if value_end < 0:
            break
        key, value = text[pos + len(_PARAMETER) : key_end], text[key_end + 2 : value_end]
        members.append(f"{json.dumps(key, ensure_ascii=False)}: {_xml_value(value, properties.get(key))}")
        pos = value_end + len(XML_PARAMETER_CLOSE)
    arguments = "{" + ", ".join(members)
    if text.startswith("</function>", pos):
        return PartialCall(name, arguments + "}", True), pos + len("</function>")
    return PartialCall(name, arguments, False), len(text)


_PARAMETER = "<parameter="


def _xml_value(value: str, schema: Any) -> str:
    """A parameter's value as JSON text: a string property's plain text as a JSON string, any other
    as the JSON it is written in (a value that is not JSON stays a string)."""
    if not is_text(schema):
        try:
            json.loads(value)
            return value
        except json.JSONDecodeError:
            pass
    return json.dumps(value, ensure_ascii=False)


def _string_end(text: str, pos: int) -> int | None:
    """The index after the JSON string starting at `pos`, or None if it is not closed yet."""
    i = pos + 1
    while i < len(text):
        c = text[i]
        if c == "\\":
            i += 2
            continue
        if c == '"':
            return i + 1
        i += 1
    return None


def _value_end(text: str, pos: int) -> int | None:
    """The index after the JSON object or array starting at `pos`, or None if it is not closed."""
    depth, i, in_string = 0, pos, False
    while i < len(text):
        c = text[i]
        if in_string:
            if c == "\\":
                i += 1
            elif c == '"':
                in_string = False
        elif c == '"':
            in_string = True
        elif c in "{[":
            depth += 1
        elif c in "}]":
            depth -= 1
            if depth == 0:
                return i + 1
        i += 1
    return None


def final_calls(
    fmt: ToolCallFormat, text: str, tools: Sequence[ToolSpec] = ()
) -> tuple[str | None, list[ToolCall]]:
    """The message of a finished reply: its content (None when it is only calls) and its whole calls.
    A call cut short (max_tokens) is left out and its text stays in the content."""
    reading = read_reply(fmt, text, tools)
    calls = [
        ToolCall(c.name, c.arguments, new_call_id(fmt.short_ids))
        for c in reading.calls
        if c.complete and c.name is not None
    ]
    if not calls:
        return text, []
    content = reading.content
    return (content if content.strip() else None), calls


class ToolCallStream:
    """Successive readings of a growing reply -> OpenAI's chat deltas: `content` until the calls
    start, then per call its id, type and name once the name is whole, then `arguments` fragments."""

    def __init__(self, fmt: ToolCallFormat, tools: Sequence[ToolSpec] = ()) -> None:
        self.fmt = fmt
        self.tools = tools
        self.content_sent = 0
        self.calls: list[ToolCall] = []  # the calls announced, with the arguments sent so far

    def update(self, text: str, finished: bool = False) -> tuple[str, list[dict[str, Any]]]:
        """The new content and the tool-call deltas for `text`, the whole reply so far."""
        reading = read_reply(self.fmt, text, self.tools)
        content_end = len(reading.content) - (0 if finished else reading.held)
        content = reading.content[self.content_sent : content_end]
        self.content_sent = max(self.content_sent, content_end)
        deltas: list[dict[str, Any]] = []
        for index, partial in enumerate(reading.calls):
            if partial.name is None:
                break
            if index == len(self.calls):
                call = ToolCall(partial.name, "", new_call_id(self.fmt.short_ids))
                self.calls.append(call)
                deltas.append({"index": index, **call.to_openai()})
            call = self.calls[index]
            fresh = partial.arguments[len(call.arguments) :]
            if fresh:
                call.arguments = partial.arguments
                deltas.append({"index": index, "function": {"arguments": fresh}})
        return content, deltas
