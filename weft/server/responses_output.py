"""A reply as the Responses API's output items, whole or streamed as its events.

One reply is, in order: a `reasoning` item (the thinking section, where the model has one), a
`message` item (its text), and a `function_call` item per call. Streamed, each item is opened
(`response.output_item.added`, for text a `response.content_part.added`), grows by deltas
(`response.reasoning_text.delta`, `response.output_text.delta`,
`response.function_call_arguments.delta`) and is closed (`...done`, `response.output_item.done`)
before the next one opens. Every event carries a `sequence_number`.
"""

from __future__ import annotations

import base64
import json
import uuid
from typing import Any

from weft.outputs import AssistantMessage


def item_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def message_item(text: str, status: str = "completed") -> dict[str, Any]:
    part = {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
    return {"type": "message", "id": item_id("msg"), "status": status, "role": "assistant", "content": [part]}


SEALED = "weft1:"  # the prefix of weft's `encrypted_content`


def seal(item: dict[str, Any]) -> dict[str, Any]:
    """A reasoning item with its thinking also as `encrypted_content` (asked for with `include:
    ["reasoning.encrypted_content"]`): opaque to a client, which hands it back on the next turn
    (`unseal`) where it keeps nothing (`store: false`). Not secret: base64 of the text."""
    item["encrypted_content"] = SEALED + base64.b64encode(item["content"][0]["text"].encode()).decode()
    return item


def unseal(content: str) -> str | None:
    """The thinking in a reasoning item's `encrypted_content`, or None if weft did not write it."""
    if not content.startswith(SEALED):
        return None
    try:
        return base64.b64decode(content[len(SEALED) :], validate=True).decode()
    except (ValueError, UnicodeDecodeError):
        return None


def reasoning_item(text: str, status: str = "completed") -> dict[str, Any]:
    part = {"type": "reasoning_text", "text": text}
    return {"type": "reasoning", "id": item_id("rs"), "summary": [], "content": [part], "status": status}


def call_item(call_id: str, name: str, arguments: str, status: str = "completed") -> dict[str, Any]:
    return {
        "type": "function_call",
        "id": item_id("fc"),
        "call_id": call_id,
        "name": name,
        "arguments": arguments,
        "status": status,
    }


def output_items(message: AssistantMessage, complete: bool) -> list[dict[str, Any]]:
    """A whole reply's items (`complete` False: cut short by max_output_tokens)."""
    status = "completed" if complete else "incomplete"
    items = []
    if message.reasoning_content:
        items.append(reasoning_item(message.reasoning_content, status))
    if message.content or not message.tool_calls:
        items.append(message_item(message.content or "", status))
    items += [call_item(c.id, c.name, c.arguments, status) for c in message.tool_calls]
    return items


def conversation_message(items: list[dict[str, Any]]) -> dict[str, Any]:
    """A reply's items as the assistant message a later turn's chat template reads."""
    message: dict[str, Any] = {"role": "assistant", "content": None}
    for item in items:
        if item["type"] == "reasoning":
            message["reasoning_content"] = item["content"][0]["text"]
        elif item["type"] == "message":
            message["content"] = item["content"][0]["text"]
        else:
            call = {"name": item["name"], "arguments": item["arguments"]}
            message.setdefault("tool_calls", []).append(
                {"id": item["call_id"], "type": "function", "function": call}
            )
    return message


class OutputEvents:
    """The events of one streamed reply, fed its chat deltas (weft/agents/reply.py's ReplyStream)."""

    def __init__(self, sealed: bool = False) -> None:
        self.items: list[dict[str, Any]] = []  # the output so far, the open item last
        self.open: dict[str, Any] | None = None
        self.sequence = 0
        self.sealed = sealed  # reasoning items carry `encrypted_content` when done (`seal`)

    def event(self, kind: str, **fields: Any) -> str:
        payload = {"type": kind, **fields, "sequence_number": self.sequence}
        self.sequence += 1
        return f"event: {kind}\ndata: {json.dumps(payload)}\n\n"

    def feed(self, delta: dict[str, Any]) -> list[str]:
        if "reasoning_content" in delta:
            return self._text("reasoning", delta["reasoning_content"])
        if "content" in delta:
            return self._text("message", delta["content"])
        events: list[str] = []
        for call in delta.get("tool_calls", ()):
            events += self._call(call)
        return events

    def finish(self, complete: bool) -> list[str]:
        """Close the open item; a reply with no text and no call still has its (empty) message."""
        events = [] if self.items else self._text("message", "")
        return events + self.close("completed" if complete else "incomplete")

    def _text(self, kind: str, text: str) -> list[str]:
        events: list[str] = []
        if self.open is None or self.open["type"] != kind:
            events += self.close()
            item = (
                reasoning_item("", "in_progress") if kind == "reasoning" else message_item("", "in_progress")
            )
            events += self._add(item)
            part = item["content"][0]
            events.append(
                self.event("response.content_part.added", **self._where(), content_index=0, part=part)
            )
        if not text:
            return events
        assert self.open is not None
        self.open["content"][0]["text"] += text
        if kind == "reasoning":
            events.append(
                self.event("response.reasoning_text.delta", **self._where(), content_index=0, delta=text)
            )
        else:
            where = self._where()
            events.append(
                self.event("response.output_text.delta", **where, content_index=0, delta=text, logprobs=[])
            )
        return events

    def _call(self, call: dict[str, Any]) -> list[str]:
        events: list[str] = []
        function = call.get("function", {})
        if "id" in call:  # a new call: its name is whole
            events += self.close()
            events += self._add(call_item(call["id"], function["name"], "", "in_progress"))
        fragment = function.get("arguments") or ""
        if fragment and self.open is not None:
            self.open["arguments"] += fragment
            events.append(
                self.event("response.function_call_arguments.delta", **self._where(), delta=fragment)
            )
        return events

    def _add(self, item: dict[str, Any]) -> list[str]:
        self.open = item
        self.items.append(item)
        shown = {**item, "content": []} if "content" in item else dict(item)
        return [self.event("response.output_item.added", output_index=len(self.items) - 1, item=shown)]

    def _where(self) -> dict[str, Any]:
        assert self.open is not None
        return {"item_id": self.open["id"], "output_index": len(self.items) - 1}

    def close(self, status: str = "completed") -> list[str]:
        item = self.open
        if item is None:
            return []
        self.open = None
        item["status"] = status
        where = {"item_id": item["id"], "output_index": len(self.items) - 1}
        events = []
        if item["type"] == "function_call":
            events.append(
                self.event(
                    "response.function_call_arguments.done",
                    **where,
                    name=item["name"],
                    arguments=item["arguments"],
                )
            )
        else:
            part = item["content"][0]
            if item["type"] == "reasoning" and self.sealed:
                seal(item)
            if item["type"] == "reasoning":
                events.append(
                    self.event("response.reasoning_text.done", **where, content_index=0, text=part["text"])
                )
            else:
                events.append(
                    self.event(
                        "response.output_text.done", **where, content_index=0, text=part["text"], logprobs=[]
                    )
                )
            events.append(self.event("response.content_part.done", **where, content_index=0, part=part))
        events.append(self.event("response.output_item.done", output_index=where["output_index"], item=item))
        return events
