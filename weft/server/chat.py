"""POST /v1/chat/completions: the chat template, response_format, tool calls, reasoning, streaming.

Tool calls. `tool_choice="auto"` (the default when tools are given) lets the model write text or
call tools in its family's own format (weft/agents/tool_formats.py, detected from the chat template
or named by `weft serve --tool-call-parser`): once it starts a call, the rest is constrained, so every
call parses and its arguments validate. `"required"` or a named function makes the whole output one
JSON document: for a named function its arguments, for "required" `{"name": ..., "parameters":
{...}}` for one of the tools. Either way the calls are returned as `tool_calls` (finish_reason
"tool_calls"). "none" gives the template no tools. With a reasoning section (weft/agents/reasoning.py)
the reasoning is returned as `reasoning_content` and constraints hold for the answer after it.
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from typing import Any

import jinja2

from weft.agents.reply import ForcedCall, ReplyPlan, ReplyStream, forced_call, plan_reply
from weft.agents.tool_formats import ToolSpec
from weft.outputs import CompletionOutput, RequestOutput
from weft.params import OutputKind
from weft.schema_objects import JsonSchemaMode
from weft.server.bodies import ChunkWriter, chat_logprobs, finish_reason, finite, smc_runs, sse, usage
from weft.server.engine_loop import RequestHandle, now
from weft.server.protocol import ChatCompletionRequest, NamedToolChoice, RequestError
from weft.server.service import GenerationFailed, Service


class Chat:
    def __init__(self, service: Service) -> None:
        self.service = service

    async def start(
        self, body: ChatCompletionRequest, request_id: str | None = None, fit_context: bool = False
    ) -> tuple[RequestHandle, ReplyPlan, str]:
        """`fit_context`: a max_tokens beyond the room the prompt leaves in the context is held to
        that room (Anthropic's clients send their own model's limit), instead of refused."""
        service = self.service
        service.check_model(body.model)
        constraint, forced, field = _constraint(body, service.json_schema_mode)
        text = self.render(body)
        plan = self._plan(body, constraint, forced, text)
        params = body.sampling_params(service.vocab_size, plan.constraint, field)
        params = params.replace(output_kind=OutputKind.DELTA if body.stream else OutputKind.FINAL_ONLY)
        if plan.reads_special_tokens:  # the markers the reply is read by may be special tokens
            params = params.replace(skip_special_tokens=False)
        service.check_limits(params)
        await service.validate_constraint(params, field)
        request_id = request_id or f"chatcmpl-{uuid.uuid4().hex}"
        length_field = "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens"
        prompt = service.tokenizer.encode(text, add_special_tokens=False)
        if fit_context and params.max_tokens is not None:
            room = service.max_model_len - len(prompt)
            if 0 < room < params.max_tokens:
                params = params.replace(max_tokens=room)
        (handle,) = await service.add_all(request_id, [prompt], params, length_field)
        return handle, plan, request_id

    def _plan(
        self, body: ChatCompletionRequest, constraint: dict[str, Any], forced: ForcedCall | None, prompt: str
    ) -> ReplyPlan:
        formats = self.service.formats
        auto = body.tools and body.tool_choice in (None, "auto")
        forced_tools = [
            ToolSpec.of(t)
            for t in body.tools or []
            if forced is not None and forced.function in (None, t.function.name)
        ]
        try:
            return plan_reply(
                constraint=constraint,
                forced=forced,
                tools=[ToolSpec.of(t) for t in body.tools or []] if auto else (),
                tool_format=formats.tool_calls,
                reasoning=formats.reasoning,
                prompt=prompt,
                added_tokens=self.service.tokenizer.added_tokens,
                mode=self.service.json_schema_mode,
                parallel_tool_calls=body.parallel_tool_calls,
                forced_tools=forced_tools,
                thinking_budget=body.thinking_budget_tokens(),
            )
        except ValueError as exc:
            raise RequestError(str(exc), "response_format" if constraint else "tools") from None

    def render(self, body: ChatCompletionRequest) -> str:
        """The prompt of a chat request: its messages (and tools) through the chat template."""
        messages = [_message(m, i) for i, m in enumerate(body.messages)]
        extra: dict[str, Any] = dict(body.chat_template_kwargs or {})
        if body.tools and body.tool_choice != "none":
            extra["tools"] = [t.model_dump() for t in body.tools]
        try:
            return self.service.tokenizer.apply_chat_template(messages, body.add_generation_prompt, **extra)
        except (jinja2.TemplateError, TypeError) as exc:
            raise RequestError(f"the chat template failed on these messages: {exc}", "messages") from None

    async def respond(
        self, body: ChatCompletionRequest, handle: RequestHandle, plan: ReplyPlan, request_id: str
    ) -> dict:
        final: RequestOutput | None = None
        async for output in handle.outputs():
            final = output
        assert final is not None
        choices, reasoning_tokens = [], 0
        for c in final.outputs:
            if c.error is not None:
                raise GenerationFailed(c.error)
            message = plan.message(c.text, finished=c.finish_reason == "stop")
            if message.reasoning_content:  # (the reasoning's text, tokenized again, as Responses counts it)
                reasoning_tokens += len(
                    self.service.tokenizer.encode(message.reasoning_content, add_special_tokens=False)
                )
            reason = "tool_calls" if message.tool_calls else finish_reason(c)
            choice = {
                "index": c.index,
                "message": message.to_openai(),
                "logprobs": self._logprobs(body, c),
                "finish_reason": reason,
            }
            if c.log_weight is not None:
                choice["log_weight"] = finite(c.log_weight)
            choices.append(choice)
        completion_tokens = sum(len(c.token_ids) for c in final.outputs)
        self.service.count(len(final.prompt_token_ids), completion_tokens)
        counts = usage(len(final.prompt_token_ids), completion_tokens)
        if plan.reasoning is not None:
            counts["completion_tokens_details"] = {"reasoning_tokens": reasoning_tokens}
        body_out = {
            "id": request_id,
            "object": "chat.completion",
            "created": now(),
            "model": self.service.model_name,
            "choices": choices,
            "usage": counts,
        }
        if final.smc is not None:
            body_out["smc"] = smc_runs(final)
        return body_out

    @staticmethod
    def _logprobs(body: ChatCompletionRequest, c: CompletionOutput) -> dict[str, Any] | None:
        if not body.logprobs or c.logprobs is None:
            return None
        return chat_logprobs(c.token_ids, list(c.logprobs), body.top_logprobs or 0)

    async def stream(
        self, body: ChatCompletionRequest, handle: RequestHandle, plan: ReplyPlan, request_id: str
    ) -> AsyncIterator[str]:
        """Chunks: the role first (per choice), then reasoning, content and tool-call deltas as
        they are made, the finish reason, a usage chunk when asked, [DONE]."""
        fields = {"id": request_id, "object": "chat.completion.chunk", "created": now()}
        chunks = ChunkWriter(fields, self.service)
        readers: dict[int, ReplyStream] = {}
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
                if c.index not in readers:
                    readers[c.index] = plan.stream()
                    yield chunks.choice(_chunk(c.index, {"role": "assistant", "content": ""}))
                for choice in self._deltas(body, c, readers[c.index]):
                    yield chunks.choice(choice)
        self.service.count(prompt_tokens, completion_tokens)
        if body.stream_options is not None and body.stream_options.include_usage:
            yield chunks.usage(prompt_tokens, completion_tokens)
        yield sse("[DONE]")

    @staticmethod
    def _deltas(
        body: ChatCompletionRequest, c: CompletionOutput, reader: ReplyStream
    ) -> list[dict[str, Any]]:
        """The chunks' choices for one output of a choice: its deltas (the logprobs on the first),
        then the finish reason on the last."""
        reason = finish_reason(c)
        deltas = reader.feed(c.text, finished=reason is not None)
        if reason == "stop" and reader.sent_calls:
            reason = "tool_calls"
        choices = [_chunk(c.index, delta) for delta in deltas]
        if reason is not None:
            if choices:
                choices[-1]["finish_reason"] = reason
            else:
                choices.append(_chunk(c.index, {}, reason))
        if body.logprobs and c.logprobs and c.token_ids:
            if not choices:
                choices.append(_chunk(c.index, {}))
            choices[0]["logprobs"] = chat_logprobs(c.token_ids, list(c.logprobs), body.top_logprobs or 0)
        return choices


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
) -> tuple[dict[str, Any], ForcedCall | None, str | None]:
    """The output constraint from response_format, a forced tool call or structured_outputs /
    guided_* (at most one of them), the forced call (read from the output), and the request's
    field that gave the constraint. A JSON Schema's
    objects are closed as `mode` says (the server's), or in OpenAI's strict mode where the request
    says `strict: true`."""
    found: list[tuple[str, dict[str, Any], ForcedCall | None]] = []
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


def _forced_tool(
    body: ChatCompletionRequest, mode: JsonSchemaMode
) -> tuple[dict[str, Any], ForcedCall] | None:
    choice = body.tool_choice
    if choice is None or choice in ("none", "auto"):
        return None
    if not body.tools:
        raise RequestError("tool_choice needs tools", "tool_choice")
    function = choice.function.get("name") if isinstance(choice, NamedToolChoice) else None
    try:
        return forced_call([ToolSpec.of(t) for t in body.tools], function, mode)
    except ValueError as exc:
        raise RequestError(str(exc), "tool_choice") from None
