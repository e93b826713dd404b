"""POST /v1/messages and /v1/messages/count_tokens: Anthropic's Messages API (what Claude Code and
the anthropic SDK speak) over the chat machinery.

A request becomes a chat request: `system` the system message (and `system` messages between the
turns, which Claude Code sends, system messages in place), content blocks chat messages (text,
`tool_use` an assistant's tool calls, `tool_result` tool messages, `thinking` the reasoning of the
assistant message it is in), `tools` function tools over their `input_schema`, `tool_choice` auto /
any / tool / none as auto / required / a named function / none, `stop_sequences` stop strings, so
tool calls, reasoning and constraints behave exactly as in /v1/chat/completions. The reply becomes
content blocks (`thinking`, `text`, `tool_use`), whole or as Anthropic's events (message_start,
content_block_start / _delta / _stop per block, message_delta with the stop reason and usage,
message_stop). Fields that do not change what is generated (`metadata`, `service_tier`,
`context_management`, ...) are accepted, and a `max_tokens` beyond the context's room is held to it
(clients send their own model's limit); server tools (a `type` other than "custom") are left out
with a header and a log line, as the Responses API does with OpenAI's built-in tools; images are
refused.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from weft.agents.reply import ReplyPlan
from weft.outputs import AssistantMessage, CompletionOutput, RequestOutput
from weft.server.chat import Chat
from weft.server.engine_loop import RequestHandle
from weft.server.protocol import ChatCompletionRequest, RequestError, Tool
from weft.server.service import GenerationFailed, Service, only_completion


class AnthropicErrorDetail(BaseModel):
    type: str
    message: str


class AnthropicError(BaseModel):
    """Anthropic's error body: {"type": "error", "error": {"type": ..., "message": ...}}."""

    type: Literal["error"]
    error: AnthropicErrorDetail


class MessageUsage(BaseModel):
    input_tokens: int
    output_tokens: int
    cache_read_input_tokens: int
    cache_creation_input_tokens: int


class MessageObject(BaseModel):
    """An Anthropic Message."""

    id: str
    type: Literal["message"]
    role: Literal["assistant"]
    model: str
    content: list[dict[str, Any]]
    stop_reason: str | None
    stop_sequence: str | None
    usage: MessageUsage


class TokenCount(BaseModel):
    input_tokens: int


MESSAGE_EVENTS = (
    "each named by `event`: message_start, then per content block content_block_start, "
    "content_block_delta (text_delta, thinking_delta, input_json_delta) and content_block_stop, then "
    "message_delta (stop_reason, usage) and message_stop; error when generation fails"
)


class MessagesRequest(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: str | None = None
    max_tokens: int | None = Field(default=None, ge=1)  # required by /v1/messages, not by count_tokens
    messages: list[dict[str, Any]] = Field(min_length=1)
    system: str | list[dict[str, Any]] | None = None
    stop_sequences: list[str] | None = None
    stream: bool = False
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: dict[str, Any] | None = None
    thinking: dict[str, Any] | None = None
    output_config: dict[str, Any] | None = None  # its `effort` bounds the thinking as reasoning_effort does
    metadata: dict[str, Any] | None = None

    def chat_request(self, stream: bool | None = None) -> ChatCompletionRequest:
        """The chat request that generates this message."""
        choice = self.tool_choice or {}
        tools = self.function_tools()
        try:
            return self._chat_request(choice, tools, self.stream if stream is None else stream)
        except ValidationError as exc:
            first = exc.errors()[0]
            where = ".".join(str(p) for p in first.get("loc", ()))
            raise RequestError(f"{where}: {first.get('msg')}", where or None) from None

    def _chat_request(self, choice: dict[str, Any], tools: list[Tool], stream: bool) -> ChatCompletionRequest:
        return ChatCompletionRequest(
            model=None,  # any name: Claude Code asks for its own; weft serves one model and echoes it
            messages=self.chat_messages(),
            stream=stream,
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            stop=self.stop_sequences,
            max_completion_tokens=self.max_tokens,
            tools=tools or None,
            tool_choice=_tool_choice(choice) if tools else None,
            parallel_tool_calls=not choice.get("disable_parallel_tool_use", False),
            chat_template_kwargs=self._template_kwargs(),
            max_reasoning_tokens=(self.thinking or {}).get("budget_tokens"),
            reasoning_effort=self._effort(),
        )

    def _template_kwargs(self) -> dict[str, Any] | None:
        """`thinking`: "enabled" and "adaptive" (the model decides) let a template think, "disabled"
        does not."""
        kind = (self.thinking or {}).get("type")
        return None if kind is None else {"enable_thinking": kind != "disabled"}

    def _effort(self) -> Literal["low", "medium", "high"] | None:
        """`output_config.effort` as a thinking budget: low, medium and high as reasoning_effort's,
        max none."""
        effort = (self.output_config or {}).get("effort")
        if effort not in (None, "low", "medium", "high", "max"):
            raise RequestError(
                f"output_config.effort must be low, medium, high or max, got {effort!r}",
                "output_config.effort",
            )
        return None if effort in (None, "max") else effort

    def function_tools(self) -> list[Tool]:
        """The client's own tools as chat function tools (server tools are left out)."""
        tools = []
        for i, t in enumerate(self.tools or []):
            if t.get("type", "custom") != "custom":
                continue
            function = {"name": t.get("name"), "description": t.get("description", "")}
            try:
                schema = t.get("input_schema") or {"type": "object"}
                tools.append(Tool.model_validate({"function": {**function, "parameters": schema}}))
            except ValidationError as exc:
                raise RequestError(f"tools[{i}]: {exc.errors()[0].get('msg')}", f"tools[{i}]") from None
        return tools

    def dropped_tools(self) -> list[str]:
        """The types of the server tools weft leaves out (web search, code execution, ...)."""
        return sorted({str(t["type"]) for t in self.tools or [] if t.get("type", "custom") != "custom"})

    def chat_messages(self) -> list[dict[str, Any]]:
        messages: list[dict[str, Any]] = []
        for i, message in enumerate([{"role": "system", "content": self.system}, *self.messages]):
            where = "system" if i == 0 else f"messages[{i - 1}]"
            try:
                messages += _system(message["content"]) if i == 0 else _chat_messages(message, where)
            except (KeyError, TypeError, AttributeError) as exc:
                raise RequestError(
                    f"{where}: a malformed message or block ({exc!r} is missing or wrong)", where
                ) from None
        return messages


def _system(system: str | list[dict[str, Any]] | None) -> list[dict[str, Any]]:
    text = system if isinstance(system, str) else _text(system or [], "system")
    return [{"role": "system", "content": text}] if text else []


def _tool_choice(choice: dict[str, Any]) -> Any:
    kind = choice.get("type", "auto")
    if kind == "tool":
        return {"type": "function", "function": {"name": choice.get("name")}}
    named = {"auto": "auto", "any": "required", "none": "none"}
    if kind not in named:
        raise RequestError(f"tool_choice type {kind!r} is not one of auto, any, tool, none", "tool_choice")
    return named[kind]


def _text(blocks: list[dict[str, Any]], where: str) -> str:
    """The text of text blocks (a system prompt's, a tool result's)."""
    parts = []
    for j, block in enumerate(blocks):
        if block.get("type") != "text":
            raise RequestError(f"{where}[{j}]: only text blocks are supported here", where)
        parts.append(str(block.get("text", "")))
    return "\n".join(parts)


def _chat_messages(message: dict[str, Any], where: str) -> list[dict[str, Any]]:
    """One Anthropic message as chat messages: a user's tool results come first, as tool messages."""
    role, content = message.get("role"), message.get("content")
    if role == "system":  # a system message mid-conversation (Claude Code sends them): kept in place
        return _system(content if isinstance(content, str) else _text(content or [], f"{where}.content"))
    if role not in ("user", "assistant"):
        raise RequestError(f"{where}.role must be user, assistant or system, got {role!r}", f"{where}.role")
    if isinstance(content, str):
        return [{"role": role, "content": content}]
    if not isinstance(content, list):
        raise RequestError(f"{where}.content must be a string or a list of blocks", f"{where}.content")
    texts, thinking, calls, results = [], [], [], []
    for j, block in enumerate(content):
        kind = block.get("type")
        if kind == "text":
            texts.append(str(block.get("text", "")))
        elif kind == "thinking" and role == "assistant":
            thinking.append(str(block.get("thinking", "")))
        elif kind == "redacted_thinking" and role == "assistant":
            continue  # another server's sealed reasoning: nothing weft can read
        elif kind == "tool_use" and role == "assistant":
            arguments = json.dumps(block.get("input") or {})
            calls.append(
                {
                    "id": block["id"],
                    "type": "function",
                    "function": {"name": block["name"], "arguments": arguments},
                }
            )
        elif kind == "tool_result" and role == "user":
            body = block.get("content", "")
            text = body if isinstance(body, str) else _text(body, f"{where}.content[{j}].content")
            results.append({"role": "tool", "tool_call_id": block["tool_use_id"], "content": text})
        else:
            raise RequestError(
                f"{where}.content[{j}]: a {kind!r} block is not supported in a {role} message",
                f"{where}.content",
            )
    chat: dict[str, Any] = {"role": role, "content": "\n".join(texts)}
    if thinking:
        chat["reasoning_content"] = "\n".join(thinking)
    if calls:
        chat["tool_calls"] = calls
    return results + ([chat] if texts or calls or thinking or not results else [])


def content_blocks(message: AssistantMessage) -> list[dict[str, Any]]:
    """A reply's message as content blocks: its thinking, its text, its tool calls."""
    blocks: list[dict[str, Any]] = []
    if message.reasoning_content:
        blocks.append({"type": "thinking", "thinking": message.reasoning_content, "signature": ""})
    if message.content:
        blocks.append({"type": "text", "text": message.content})
    for call in message.tool_calls:
        blocks.append({"type": "tool_use", "id": call.id, "name": call.name, "input": _input(call.arguments)})
    return blocks


def _input(arguments: str) -> Any:
    try:
        return json.loads(arguments)
    except json.JSONDecodeError:
        return {}


def stop_reason(c: CompletionOutput, calls: bool) -> tuple[str, str | None]:
    """(stop_reason, stop_sequence) of a finished reply."""
    if calls:
        return "tool_use", None
    if c.finish_reason == "length":
        return "max_tokens", None
    if isinstance(c.stop_reason, str):
        return "stop_sequence", c.stop_reason
    return "end_turn", None


def event(kind: str, **data: Any) -> str:
    return f"event: {kind}\ndata: {json.dumps({'type': kind, **data})}\n\n"


@dataclass(slots=True)
class BlockEvents:
    """Chat deltas -> Anthropic's content block events, one block open at a time."""

    index: int = -1
    open_kind: str | None = None  # "thinking", "text", "tool_use"
    calls: dict[int, int] = field(default_factory=dict)  # a tool call's index -> its block's

    def feed(self, delta: dict[str, Any]) -> list[str]:
        out: list[str] = []
        if delta.get("reasoning_content"):
            out += self._open("thinking", {"type": "thinking", "thinking": "", "signature": ""})
            out.append(self._delta({"type": "thinking_delta", "thinking": delta["reasoning_content"]}))
        if delta.get("content"):
            out += self._open("text", {"type": "text", "text": ""})
            out.append(self._delta({"type": "text_delta", "text": delta["content"]}))
        for call in delta.get("tool_calls") or []:
            function = call.get("function") or {}
            if call.get("id"):
                block = {"type": "tool_use", "id": call["id"], "name": function.get("name"), "input": {}}
                out += self._open("tool_use", block, force=True)
                self.calls[call["index"]] = self.index
            if function.get("arguments"):
                out.append(self._delta({"type": "input_json_delta", "partial_json": function["arguments"]}))
        return out

    def _open(self, kind: str, block: dict[str, Any], force: bool = False) -> list[str]:
        if self.open_kind == kind and not force:
            return []
        out = self.close()
        self.index, self.open_kind = self.index + 1, kind
        return [*out, event("content_block_start", index=self.index, content_block=block)]

    def _delta(self, delta: dict[str, Any]) -> str:
        return event("content_block_delta", index=self.index, delta=delta)

    def close(self) -> list[str]:
        if self.open_kind is None:
            return []
        self.open_kind = None
        return [event("content_block_stop", index=self.index)]


@dataclass(slots=True)
class MessageRun:
    request: MessagesRequest
    handle: RequestHandle
    plan: ReplyPlan
    message_id: str


class Messages:
    def __init__(self, chat: Chat) -> None:
        self.chat = chat
        self.service: Service = chat.service

    async def start(self, request: MessagesRequest) -> MessageRun:
        if request.max_tokens is None:
            raise RequestError(
                "max_tokens: Field required (the most tokens the reply may have)", "max_tokens"
            )
        message_id = f"msg_{uuid.uuid4().hex}"
        handle, plan, _ = await self.chat.start(request.chat_request(), message_id, fit_context=True)
        return MessageRun(request, handle, plan, message_id)

    def count_tokens(self, request: MessagesRequest) -> dict[str, int]:
        text = self.chat.render(request.chat_request(stream=False))
        return {"input_tokens": len(self.service.tokenizer.encode(text, add_special_tokens=False))}

    async def respond(self, run: MessageRun) -> dict[str, Any]:
        final, c = await only_completion(run.handle)
        message = run.plan.message(c.text, finished=c.finish_reason == "stop")
        reason, sequence = stop_reason(c, bool(message.tool_calls))
        self.service.count(len(final.prompt_token_ids), len(c.token_ids))
        body = self._body(run, final, content_blocks(message), len(c.token_ids))
        return {**body, "stop_reason": reason, "stop_sequence": sequence}

    async def stream(self, run: MessageRun) -> AsyncIterator[str]:
        reader, blocks, tracker = run.plan.stream(), BlockEvents(), self.service.tracker()
        last: RequestOutput | None = None
        tokens, calls = 0, False
        async for out in run.handle.outputs():
            (c,) = out.outputs
            if c.error is not None:
                raise GenerationFailed(c.error)
            if last is None:
                yield event("message_start", message={**self._body(run, out, [], 0), "stop_reason": None})
            if c.token_ids:
                tracker.tokens_arrived()
            last, tokens = out, tokens + len(c.token_ids)
            for delta in reader.feed(c.text, finished=c.finish_reason is not None):
                calls = calls or bool(delta.get("tool_calls"))
                for text in blocks.feed(delta):
                    yield text
        assert last is not None
        for text in blocks.close():
            yield text
        self.service.count(len(last.prompt_token_ids), tokens)
        reason, sequence = stop_reason(last.outputs[0], calls)
        yield event(
            "message_delta",
            delta={"stop_reason": reason, "stop_sequence": sequence},
            usage={"output_tokens": tokens},
        )
        yield event("message_stop")

    @staticmethod
    def failed(error: Exception) -> list[str]:
        return [event("error", error={"type": "api_error", "message": str(error)})]

    def _body(
        self, run: MessageRun, output: RequestOutput, content: list[dict[str, Any]], tokens: int
    ) -> dict[str, Any]:
        return {
            "id": run.message_id,
            "type": "message",
            "role": "assistant",
            "model": run.request.model or self.service.model_name,
            "content": content,
            "stop_sequence": None,
            "usage": {
                "input_tokens": len(output.prompt_token_ids),
                "output_tokens": tokens,
                "cache_read_input_tokens": output.num_cached_tokens,
                "cache_creation_input_tokens": 0,
            },
        }
