"""POST /v1/responses (and GET / DELETE /v1/responses/{id}): OpenAI's Responses API over the chat
machinery.

A request becomes a chat request (weft/server/responses_request.py), so tool calls, reasoning,
`text.format` and every constraint behave exactly as in /v1/chat/completions; its reply becomes output
items (weft/server/responses_output.py). With `store` (the default) the finished response and its
conversation are kept in memory, the last `--max-stored-responses` of them, for
`previous_response_id` and GET; `store: false` keeps nothing.
"""

from __future__ import annotations

import uuid
from collections import OrderedDict
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from weft.agents.reply import ReplyPlan
from weft.outputs import RequestOutput
from weft.server.chat import Chat
from weft.server.engine_loop import RequestHandle, now
from weft.server.protocol import RequestError
from weft.server.responses_output import OutputEvents, conversation_message, output_items, seal
from weft.server.responses_request import ResponsesRequest, renamed
from weft.server.service import GenerationFailed, Service, only_completion


class UnknownResponse(Exception):
    """A response id that is not (or no longer) stored; `param` names the request's field."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


@dataclass(slots=True)
class StoredResponse:
    body: dict[str, Any]  # the Response object
    conversation: list[dict[str, Any]]  # its chat messages, its reply last (instructions left out)


class ResponseStore:
    """The last `capacity` stored responses, in memory (the oldest goes first)."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._entries: OrderedDict[str, StoredResponse] = OrderedDict()

    def put(self, response_id: str, stored: StoredResponse) -> None:
        if self.capacity <= 0:
            return
        self._entries[response_id] = stored
        while len(self._entries) > self.capacity:
            self._entries.popitem(last=False)

    def get(self, response_id: str, param: str | None = None) -> StoredResponse:
        stored = self._entries.get(response_id)
        if stored is None:
            raise UnknownResponse(
                f"no stored response {response_id!r}: responses are kept in memory (the last "
                f"{self.capacity}, and only those made with store: true) until the server stops",
                param,
            )
        return stored

    def delete(self, response_id: str) -> None:
        self.get(response_id, "response_id")
        del self._entries[response_id]

    def __len__(self) -> int:
        return len(self._entries)


@dataclass(slots=True)
class ResponseRun:
    """One response being generated."""

    request: ResponsesRequest
    handle: RequestHandle
    plan: ReplyPlan
    response_id: str
    conversation: list[dict[str, Any]]
    created_at: int = field(default_factory=now)
    events: OutputEvents = field(default_factory=OutputEvents)


class Responses:
    def __init__(self, chat: Chat, store: ResponseStore) -> None:
        self.chat = chat
        self.service: Service = chat.service
        self.store = store

    async def start(self, request: ResponsesRequest) -> ResponseRun:
        request.check_supported()
        self.service.check_model(request.model)
        history: list[dict[str, Any]] = []
        if request.previous_response_id is not None:
            history = self.store.get(request.previous_response_id, "previous_response_id").conversation
        conversation = history + request.messages()
        if not conversation:
            raise RequestError("input is empty", "input")
        system = [{"role": "system", "content": request.instructions}] if request.instructions else []
        response_id = f"resp_{uuid.uuid4().hex}"
        try:
            chat = request.chat_request(system + conversation)
            handle, plan, _ = await self.chat.start(chat, response_id)
        except RequestError as exc:
            raise renamed(exc) from None
        sealed = request.sealed_reasoning
        return ResponseRun(request, handle, plan, response_id, conversation, events=OutputEvents(sealed))

    async def respond(self, run: ResponseRun) -> dict[str, Any]:
        final, c = await only_completion(run.handle)
        complete = c.finish_reason != "length"
        message = run.plan.message(c.text, finished=c.finish_reason == "stop")
        items = output_items(message, complete)
        if run.request.sealed_reasoning:
            items = [seal(item) if item["type"] == "reasoning" else item for item in items]
        self.service.count(len(final.prompt_token_ids), len(c.token_ids))
        usage = self._usage(final, len(c.token_ids), message.reasoning_content)
        return self._finish(run, items, complete, usage)

    async def stream(self, run: ResponseRun) -> AsyncIterator[str]:
        """response.created, response.in_progress, the items' events, then response.completed (or
        response.incomplete, cut short by max_output_tokens)."""
        events, reader, tracker = run.events, run.plan.stream(), self.service.tracker()
        started = self.body(run, "in_progress", [])
        yield events.event("response.created", response=started)
        yield events.event("response.in_progress", response=started)
        last: RequestOutput | None = None
        completion_tokens, complete = 0, True
        async for out in run.handle.outputs():
            (c,) = out.outputs
            if c.error is not None:
                raise GenerationFailed(c.error)
            if c.token_ids:
                tracker.tokens_arrived()
            last, completion_tokens = out, completion_tokens + len(c.token_ids)
            complete = c.finish_reason != "length"
            for delta in reader.feed(c.text, finished=c.finish_reason is not None):
                for event in events.feed(delta):
                    yield event
        for event in events.finish(complete):
            yield event
        assert last is not None
        self.service.count(len(last.prompt_token_ids), completion_tokens)
        reasoning = next((i["content"][0]["text"] for i in events.items if i["type"] == "reasoning"), None)
        body = self._finish(run, events.items, complete, self._usage(last, completion_tokens, reasoning))
        yield events.event("response.completed" if complete else "response.incomplete", response=body)

    def failed(self, run: ResponseRun, error: Exception) -> list[str]:
        """The events of a stream that fails: `error`, then `response.failed`."""
        body = self.body(run, "failed", run.events.items)
        body["error"] = {"code": "server_error", "message": str(error)}
        return [
            run.events.event("error", code="server_error", message=str(error), param=None),
            run.events.event("response.failed", response=body),
        ]

    def _finish(
        self, run: ResponseRun, items: list[dict[str, Any]], complete: bool, usage: dict[str, Any]
    ) -> dict[str, Any]:
        body = self.body(run, "completed" if complete else "incomplete", items, usage)
        if self._stores(run.request):
            self.store.put(
                run.response_id, StoredResponse(body, [*run.conversation, conversation_message(items)])
            )
        return body

    @staticmethod
    def _stores(request: ResponsesRequest) -> bool:
        return request.store is not False

    def _usage(self, final: RequestOutput, completion_tokens: int, reasoning: str | None) -> dict[str, Any]:
        prompt_tokens = len(final.prompt_token_ids)
        reasoning_tokens = (
            len(self.service.tokenizer.encode(reasoning, add_special_tokens=False)) if reasoning else 0
        )
        return {
            "input_tokens": prompt_tokens,
            "input_tokens_details": {"cached_tokens": final.num_cached_tokens, "cache_write_tokens": 0},
            "output_tokens": completion_tokens,
            "output_tokens_details": {"reasoning_tokens": reasoning_tokens},
            "total_tokens": prompt_tokens + completion_tokens,
        }

    def body(
        self, run: ResponseRun, status: str, items: list[dict[str, Any]], usage: dict[str, Any] | None = None
    ) -> dict[str, Any]:
        """The Response object, echoing what the request asked for."""
        request = run.request
        fmt = request.format
        body = {
            "id": run.response_id,
            "object": "response",
            "created_at": run.created_at,
            "status": status,
            "completed_at": now() if status in ("completed", "incomplete") else None,
            "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "instructions": request.instructions,
            "max_output_tokens": request.max_output_tokens,
            "model": self.service.model_name,
            "output": items,
            "parallel_tool_calls": request.parallel_tool_calls is not False,
            "previous_response_id": request.previous_response_id,
            "reasoning": {"effort": (request.reasoning or {}).get("effort"), "summary": None},
            "store": self._stores(request),
            "temperature": 1.0 if request.temperature is None else request.temperature,
            "top_p": 1.0 if request.top_p is None else request.top_p,
            "text": {"format": fmt.model_dump(by_alias=True, exclude_none=True) if fmt else {"type": "text"}},
            "tool_choice": request.tool_choice or "auto",
            "tools": [_echoed_tool(t) for t in request.tools or []],
            "truncation": "disabled",
            "metadata": request.metadata or {},
            "service_tier": "default",
            "background": False,
        }
        if usage is not None:  # once finished
            body["usage"] = usage
        for name in ("user", "safety_identifier", "prompt_cache_key"):  # echoed where given
            if getattr(request, name) is not None:
                body[name] = getattr(request, name)
        return body

    def retrieve(self, response_id: str) -> dict[str, Any]:
        return self.store.get(response_id, "response_id").body

    def delete(self, response_id: str) -> dict[str, Any]:
        self.store.delete(response_id)
        return {"id": response_id, "object": "response.deleted", "deleted": True}


def _echoed_tool(tool: dict[str, Any]) -> dict[str, Any]:
    """A request's tool as the response states it: a function in full, a built-in tool weft left
    out (web_search, namespace, ...) as the client gave it."""
    if tool.get("type") != "function":
        return tool
    return {
        "type": "function",
        "name": tool.get("name"),
        "description": tool.get("description"),
        "parameters": tool.get("parameters"),
        "strict": tool.get("strict"),
    }
