"""POST /v1/chat/completions: the chat template, response_format, tool calls, streaming.

Tool calls. `tool_choice="required"` or a named function makes the output a JSON document that
the constraint guarantees: for a named function, its arguments (valid against its `parameters`
schema); for "required", `{"name": ..., "parameters": {...}}` for one of the tools. It is returned
as `tool_calls` (finish_reason "tool_calls"), so the arguments always parse and validate. With
"auto" the tools are given to the chat template (as `tools`) and the model's reply is returned as
text content: weft parses no tool call out of free text. "none" gives the template no tools.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import jinja2

from weft.outputs import CompletionOutput, RequestOutput
from weft.params import OutputKind
from weft.schema_objects import JsonSchemaMode, apply_mode
from weft.server.engine_loop import RequestHandle, now
from weft.server.protocol import ChatCompletionRequest, NamedToolChoice, RequestError, Tool
from weft.server.responses import ChunkWriter, chat_logprobs, finish_reason, sse, usage
from weft.server.service import GenerationFailed, Service


@dataclass(frozen=True, slots=True)
class ToolMode:
    """How the reply becomes a tool call: the function named (None: the JSON names it)."""

    function: str | None


class Chat:
    def __init__(self, service: Service) -> None:
        self.service = service

    async def start(self, body: ChatCompletionRequest) -> tuple[RequestHandle, ToolMode | None, str]:
        service = self.service
        service.check_model(body.model)
        constraint, tool_mode, field = _constraint(body, service.json_schema_mode)
        params = body.sampling_params(service.vocab_size, constraint, field)
        params = params.replace(output_kind=OutputKind.DELTA if body.stream else OutputKind.FINAL_ONLY)
        service.check_limits(params)
        await service.validate_constraint(params, field)
        prompt = self._render(body, tool_mode)
        request_id = f"chatcmpl-{uuid.uuid4().hex}"
        length_field = "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens"
        (handle,) = await service.add_all(request_id, [prompt], params, length_field)
        return handle, tool_mode, request_id

    def _render(self, body: ChatCompletionRequest, tool_mode: ToolMode | None) -> list[int]:
        messages = [_message(m, i) for i, m in enumerate(body.messages)]
        extra: dict[str, Any] = {}
        if body.tools and body.tool_choice != "none":
            extra["tools"] = [t.model_dump() for t in body.tools]
        tokenizer = self.service.tokenizer
        try:
            text = tokenizer.apply_chat_template(messages, body.add_generation_prompt, **extra)
        except (jinja2.TemplateError, TypeError) as exc:
            raise RequestError(f"the chat template failed on these messages: {exc}", "messages") from None
        return tokenizer.encode(text, add_special_tokens=False)

    async def respond(
        self, body: ChatCompletionRequest, handle: RequestHandle, tool_mode: ToolMode | None, request_id: str
    ) -> dict:
        final: RequestOutput | None = None
        async for output in handle.outputs():
            final = output
        assert final is not None
        choices = []
        for c in final.outputs:
            if c.error is not None:
                raise GenerationFailed(c.error)
            message, reason = _message_out(c, tool_mode, body)
            choices.append(
                {
                    "index": c.index,
                    "message": message,
                    "logprobs": self._logprobs(body, c),
                    "finish_reason": reason,
                }
            )
        completion_tokens = sum(len(c.token_ids) for c in final.outputs)
        self.service.count(len(final.prompt_token_ids), completion_tokens)
        return {
            "id": request_id,
            "object": "chat.completion",
            "created": now(),
            "model": self.service.model_name,
            "choices": choices,
            "usage": usage(len(final.prompt_token_ids), completion_tokens),
        }

    @staticmethod
    def _logprobs(body: ChatCompletionRequest, c: CompletionOutput) -> dict[str, Any] | None:
        if not body.logprobs or c.logprobs is None:
            return None
        return chat_logprobs(c.token_ids, list(c.logprobs), body.top_logprobs or 0)

    async def stream(
        self, body: ChatCompletionRequest, handle: RequestHandle, tool_mode: ToolMode | None, request_id: str
    ) -> AsyncIterator[str]:
        """Chunks: the role first (per choice), then content deltas, the finish reason, a usage
        chunk when asked, [DONE]. A tool call is sent whole, in the chunk that finishes it."""
        fields = {"id": request_id, "object": "chat.completion.chunk", "created": now()}
        chunks = ChunkWriter(fields, self.service)
        started: set[int] = set()
        buffered: dict[int, str] = {}
        tracker = self.service.tracker()
        prompt_tokens, completion_tokens = 0, 0
        async for out in handle.outputs():
            prompt_tokens = len(out.prompt_token_ids)
            if any(c.token_ids for c in out.outputs):
                tracker.tokens_arrived()
            for c in out.outputs:
                if c.error is not None:
                    raise GenerationFailed(c.error)
                completion_tokens += len(c.token_ids)
                if c.index not in started:
                    started.add(c.index)
                    yield chunks.choice(_chunk(c.index, {"role": "assistant", "content": ""}))
                delta: dict[str, Any] = {}
                reason = finish_reason(c)
                if tool_mode is None:
                    if c.text:
                        delta["content"] = c.text
                else:
                    buffered[c.index] = buffered.get(c.index, "") + c.text
                    if c.finish_reason is not None:
                        whole = CompletionOutput(c.index, buffered[c.index], [], c.finish_reason)
                        message, reason = _message_out(whole, tool_mode, body)
                        delta["tool_calls"] = [
                            {"index": 0, **call} for call in message.get("tool_calls") or []
                        ]
                if not delta and reason is None:
                    continue
                choice = _chunk(c.index, delta, reason)
                if body.logprobs and c.logprobs:
                    choice["logprobs"] = chat_logprobs(c.token_ids, list(c.logprobs), body.top_logprobs or 0)
                yield chunks.choice(choice)
        self.service.count(prompt_tokens, completion_tokens)
        if body.stream_options is not None and body.stream_options.include_usage:
            yield chunks.usage(prompt_tokens, completion_tokens)
        yield sse("[DONE]")


def _chunk(index: int, delta: dict[str, Any], reason: str | None = None) -> dict[str, Any]:
    return {"index": index, "delta": delta, "logprobs": None, "finish_reason": reason}


def _message(message: dict[str, Any], index: int) -> dict[str, Any]:
    """A request message for the template: content given as a list of text parts is joined."""
    if not isinstance(message, dict) or "role" not in message:
        raise RequestError(f"messages[{index}] must be an object with a role", "messages")
    content = message.get("content")
    if isinstance(content, list):
        texts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text":
                raise RequestError(f"messages[{index}]: only text content parts are supported", "messages")
            texts.append(str(part.get("text", "")))
        message = {**message, "content": "".join(texts)}
    return message


def _constraint(
    body: ChatCompletionRequest, mode: JsonSchemaMode
) -> tuple[dict[str, Any], ToolMode | None, str | None]:
    """The output constraint from response_format, a forced tool call or structured_outputs /
    guided_* (at most one of them), how a tool call is read from the output, and the request's
    field that gave the constraint. A JSON Schema's
    objects are closed as `mode` says (the server's), or in OpenAI's strict mode where the request
    says `strict: true`."""
    found: list[tuple[str, dict[str, Any], ToolMode | None]] = []
    fmt = body.response_format
    if fmt is not None and fmt.type == "json_object":
        found.append(("response_format", {"json_object": True}, None))
    elif fmt is not None and fmt.type == "json_schema":
        spec = fmt.json_schema or {}
        if not isinstance(spec.get("schema"), dict):
            raise RequestError(
                "response_format.json_schema.schema must be a JSON Schema object", "response_format"
            )
        strict = JsonSchemaMode.STRICT if spec.get("strict") is True else mode
        found.append(("response_format", {"json_schema": spec["schema"], "json_schema_mode": strict}, None))
    forced = _forced_tool(body, mode)
    if forced is not None:
        found.append(("tool_choice", *forced))
    other = body.constraint()
    if other:
        source = body.constraint_field() or "structured_outputs"
        found.append((source, {**other, "json_schema_mode": mode}, None))
    if len(found) > 1:
        raise RequestError(
            f"at most one output constraint, got {', '.join(n for n, _, _ in found)}", found[1][0]
        )
    return (found[0][1], found[0][2], found[0][0]) if found else ({}, None, None)


def _forced_tool(body: ChatCompletionRequest, mode: JsonSchemaMode) -> tuple[dict[str, Any], ToolMode] | None:
    choice = body.tool_choice
    if choice is None or choice in ("none", "auto"):
        return None
    tools = body.tools or []
    if not tools:
        raise RequestError("tool_choice needs tools", "tool_choice")
    if isinstance(choice, NamedToolChoice):
        name = choice.function.get("name")
        tool = next((t for t in tools if t.function.name == name), None)
        if tool is None:
            raise RequestError(f"tool_choice names {name!r}, which is not among the tools", "tool_choice")
        return {"json_schema": _parameters(tool, mode), "json_schema_mode": JsonSchemaMode.OPEN}, ToolMode(
            tool.function.name
        )
    schema = {
        "anyOf": [
            {
                "type": "object",
                "properties": {"name": {"const": t.function.name}, "parameters": _parameters(t, mode)},
                "required": ["name", "parameters"],
                "additionalProperties": False,
            }
            for t in tools
        ]
    }
    return {"json_schema": schema, "json_schema_mode": JsonSchemaMode.OPEN}, ToolMode(None)


def _parameters(tool: Tool, mode: JsonSchemaMode) -> dict[str, Any]:
    """The tool's arguments schema, its objects closed as its own `strict` or the server says."""
    schema = tool.function.parameters or {"type": "object", "properties": {}}
    return apply_mode(schema, JsonSchemaMode.STRICT if tool.function.strict else mode)


def _message_out(
    c: CompletionOutput, tool_mode: ToolMode | None, body: ChatCompletionRequest
) -> tuple[dict[str, Any], str | None]:
    """The assistant message of a finished choice, and its finish reason."""
    reason = finish_reason(c)
    if tool_mode is None or c.finish_reason != "stop":
        return {"role": "assistant", "content": c.text, "refusal": None}, reason
    try:
        document = json.loads(c.text)
    except json.JSONDecodeError:  # cannot happen under the constraint, unless it was cut short
        return {"role": "assistant", "content": c.text, "refusal": None}, reason
    if tool_mode.function is not None:
        name, arguments = tool_mode.function, document
    else:
        name, arguments = document["name"], document["parameters"]
    call = {
        "id": f"call_{uuid.uuid4().hex[:24]}",
        "type": "function",
        "function": {"name": name, "arguments": json.dumps(arguments)},
    }
    return {"role": "assistant", "content": None, "refusal": None, "tool_calls": [call]}, "tool_calls"
