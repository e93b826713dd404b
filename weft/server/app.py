"""The ASGI app: routes, authentication, the body limit and errors in the OpenAI shape.

Status codes: 400 for invalid parameters, schemas, grammars, prompts longer than the context, n
or logprobs above the limits; 401 for a missing or wrong API key; 404 for an unknown model or
route; 413 for a body over the limit; 503 when the server already holds `max_pending` requests.
A client that disconnects (mid-stream, or while it waits for a whole response) aborts its request,
which frees its KV blocks at once.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.routing import Match
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from weft.agents.chat_tools import AgentFormats
from weft.engine.engine import LLMEngine
from weft.schema_objects import JsonSchemaMode
from weft.server.bodies import error_body, sse
from weft.server.chat import Chat
from weft.server.completions import Completions
from weft.server.documents import (
    ChatCompletionResponse,
    CompletionResponse,
    DeletedResponse,
    Health,
    ModelList,
    ResponseObject,
    ok,
)
from weft.server.engine_loop import EngineLoop, QueueFull, now
from weft.server.messages import (
    MESSAGE_EVENTS,
    AnthropicError,
    MessageObject,
    Messages,
    MessagesRequest,
    TokenCount,
)
from weft.server.protocol import ChatCompletionRequest, CompletionRequest, ErrorResponse, RequestError
from weft.server.responses_endpoint import Responses, ResponseStore, UnknownResponse
from weft.server.responses_request import ResponsesRequest
from weft.server.service import GenerationFailed, Service, UnknownModel

log = logging.getLogger("weft.server")


@dataclass(frozen=True, slots=True)
class ServerConfig:
    model_name: str
    api_key: str | None = None
    max_body_bytes: int = 4 * 1024 * 1024
    max_pending: int = 1024
    max_n: int = 128  # sequences per request (n, best_of)
    # objects of a request's JSON Schema without `additionalProperties`: closed, or open (JSON
    # Schema's meaning); a request's `strict: true` is OpenAI's strict mode either way
    json_schema_mode: JsonSchemaMode = JsonSchemaMode.CLOSED
    engine_thread: bool = True  # False: the caller runs `app.state.engine_loop.run()` itself
    # the tool-call format of "auto" and the reasoning section: a name, "none", or None (detected
    # from the chat template)
    tool_call_parser: str | None = None
    reasoning_parser: str | None = None
    max_stored_responses: int = 1000  # /v1/responses kept for previous_response_id (0: none)


def build_app(engine: LLMEngine, config: ServerConfig) -> FastAPI:
    loop = EngineLoop(engine, config.max_pending)
    service = Service(
        loop,
        config.model_name,
        config.max_n,
        config.json_schema_mode,
        AgentFormats.of(engine.tokenizer.chat_template, config.tool_call_parser, config.reasoning_parser),
    )
    completions, chat = Completions(service), Chat(service)
    responses = Responses(chat, ResponseStore(config.max_stored_responses))

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        loop.start(own_thread=config.engine_thread)
        try:
            yield
        finally:
            loop.stop()

    app = FastAPI(title="weft", lifespan=lifespan)
    app.state.service = service
    app.state.engine_loop = loop
    _add_error_handlers(app, service)
    app.add_middleware(_Guard, api_key=config.api_key, max_body_bytes=config.max_body_bytes)

    _add_status_routes(app, service)

    @app.post("/v1/completions", responses={200: ok(CompletionResponse, CHUNKS), **ERRORS})
    async def create_completion(body: CompletionRequest, request: Request) -> Response:
        body, handles, request_id = await completions.start(body)
        if body.stream:
            return _stream(service, completions.stream(body, handles, request_id))
        return await _until_disconnect(request, service, completions.respond(body, handles, request_id))

    @app.post("/v1/chat/completions", responses={200: ok(ChatCompletionResponse, CHUNKS), **ERRORS})
    async def create_chat_completion(body: ChatCompletionRequest, request: Request) -> Response:
        handle, plan, request_id = await chat.start(body)
        if body.stream:
            return _stream(service, chat.stream(body, handle, plan, request_id))
        return await _until_disconnect(request, service, chat.respond(body, handle, plan, request_id))

    _add_responses_routes(app, service, responses)
    _add_messages_routes(app, service, Messages(chat))
    app.openapi = lambda: _openapi(app)  # type: ignore[method-assign]
    return app


def _add_status_routes(app: FastAPI, service: Service) -> None:
    """/health, /v1/models and /metrics."""
    unavailable = {
        "model": Health,
        "description": '{"status": "loading"} or {"status": "draining"} (weft/server/gate.py)',
    }

    @app.get("/health", responses={200: ok(Health), 503: unavailable})
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/v1/models", responses={200: ok(ModelList), 401: ERRORS[401]})
    async def models() -> dict[str, Any]:
        card = {"id": service.model_name, "object": "model", "created": now(), "owned_by": "weft"}
        return {"object": "list", "data": [{**card, "max_model_len": service.max_model_len}]}

    @app.get("/metrics", response_class=PlainTextResponse)
    async def metrics() -> Response:
        return Response(service.metrics.render(), media_type="text/plain; version=0.0.4")


CHUNKS = "the JSON chunks as `data`, then `data: [DONE]`"
RESPONSE_EVENTS = (
    "each named by `event` (response.created, response.in_progress, response.output_item.added, "
    "response.content_part.added, response.output_text.delta, response.reasoning_text.delta, "
    "response.function_call_arguments.delta, their .done, response.output_item.done, then "
    "response.completed or response.incomplete; error and response.failed when generation fails), "
    "its JSON as `data`"
)


def _add_responses_routes(app: FastAPI, service: Service, responses: Responses) -> None:
    create_errors = {
        **ERRORS,
        404: {**ERRORS[404], "description": "an unknown model or previous_response_id"},
    }

    @app.post("/v1/responses", responses={200: ok(ResponseObject, RESPONSE_EVENTS), **create_errors})
    async def create_response(body: ResponsesRequest, request: Request) -> Response:
        run = await responses.start(body)
        if body.stream:
            reply: Response = _stream(service, responses.stream(run), lambda exc: responses.failed(run, exc))
        else:
            reply = await _until_disconnect(request, service, responses.respond(run))
        dropped = body.dropped_tools()
        if dropped:  # built-in tools weft cannot run: left out, said in a header and the log
            warning = f"tools of type {', '.join(dropped)} were left out: weft runs function tools only"
            log.warning("POST /v1/responses: %s", warning)
            reply.headers["x-weft-warning"] = warning
        return reply

    stored: dict[int | str, dict[str, Any]] = {
        401: ERRORS[401],
        404: {**ERRORS[404], "description": "no such stored response"},
    }

    @app.get("/v1/responses/{response_id}", responses={200: ok(ResponseObject), **stored})
    async def retrieve_response(response_id: str) -> dict[str, Any]:
        return responses.retrieve(response_id)

    @app.delete("/v1/responses/{response_id}", responses={200: ok(DeletedResponse), **stored})
    async def delete_response(response_id: str) -> dict[str, Any]:
        return responses.delete(response_id)


MESSAGES = "/v1/messages"  # Anthropic's API: its errors in its own shape
_ANTHROPIC_ERRORS = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
                     413: "request_too_large", 503: "overloaded_error"}  # fmt: skip


def _add_messages_routes(app: FastAPI, service: Service, messages: Messages) -> None:
    errors: dict[int | str, dict[str, Any]] = {
        status: {"model": AnthropicError, "description": description}
        for status, description in (
            (400, "invalid parameters or messages"),
            (401, "a missing or wrong API key (x-api-key or Authorization: Bearer)"),
            (413, "a body over --max-body-bytes"),
            (503, "--max-pending requests already in flight, or the server is loading or draining"),
        )
    }

    @app.post(MESSAGES, responses={200: ok(MessageObject, MESSAGE_EVENTS), **errors})
    async def create_message(body: MessagesRequest, request: Request) -> Response:
        run = await messages.start(body)
        if body.stream:
            reply: Response = _stream(service, messages.stream(run), messages.failed)
        else:
            reply = await _until_disconnect(request, service, messages.respond(run))
        dropped = body.dropped_tools()
        if dropped:  # server tools weft cannot run: left out, said in a header and the log
            warning = (
                f"tools of type {', '.join(dropped)} were left out: weft runs the client's own tools only"
            )
            log.warning("POST %s: %s", MESSAGES, warning)
            reply.headers["x-weft-warning"] = warning
        return reply

    @app.post(MESSAGES + "/count_tokens", responses={200: ok(TokenCount), **errors})
    async def count_message_tokens(body: MessagesRequest) -> dict[str, int]:
        return messages.count_tokens(body)


# what the /v1/ routes answer besides 200, each with OpenAI's error body
ERRORS: dict[int | str, dict[str, Any]] = {
    status: {"model": ErrorResponse, "description": description}
    for status, description in (
        (400, "invalid parameters, schema, grammar or prompt (`param` names the field)"),
        (401, "a missing or wrong API key"),
        (404, "an unknown model"),
        (413, "a body over --max-body-bytes"),
        (503, "--max-pending requests already in flight, or the server is loading or draining"),
    )
}


def _openapi(app: FastAPI) -> dict[str, Any]:
    """FastAPI's document, less the 422 it adds to every route with a body: weft answers a body
    that does not validate with a 400 (documented)."""
    if app.openapi_schema is None:
        schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
        for operations in schema["paths"].values():
            for operation in operations.values():
                operation.get("responses", {}).pop("422", None)
        for name in ("HTTPValidationError", "ValidationError"):
            schema.get("components", {}).get("schemas", {}).pop(name, None)
        app.openapi_schema = schema
    return app.openapi_schema


async def _until_disconnect(request: Request, service: Service, work: Awaitable[dict]) -> Response:
    """The response, unless the client goes away first: then the work is cancelled, which aborts
    its requests."""
    task = asyncio.ensure_future(work)
    gone = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({task, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
    if not task.done():
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        service.metrics.requests.labels("aborted").inc()
        return Response(status_code=499)
    result = task.result()  # raises the request's error, for the handlers
    service.metrics.requests.labels("ok").inc()
    return JSONResponse(result)


async def _disconnected(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


def _chat_error(exc: Exception) -> list[str]:
    kind = "server_error" if isinstance(exc, RuntimeError) else "invalid_request_error"
    return [sse(error_body(str(exc), kind)), sse("[DONE]")]


def _stream(
    service: Service,
    events: AsyncIterator[str],
    error_events: Callable[[Exception], list[str]] = _chat_error,
) -> StreamingResponse:
    """`events` as server-sent events; a request that fails on the way ends with `error_events`."""

    async def guarded() -> AsyncIterator[str]:
        status = "aborted"  # unless it runs to its end: a client that left closes the generator
        try:
            async for event in events:
                yield event
            status = "ok"
        except (GenerationFailed, RuntimeError, ValueError) as exc:
            status = "error"
            for event in error_events(exc):
                yield event
        finally:
            service.metrics.requests.labels(status).inc()

    return StreamingResponse(guarded(), media_type="text/event-stream")


def _error(
    status: int,
    message: str,
    kind: str,
    param: str | None = None,
    code: str | None = None,
    path: str = "",
) -> JSONResponse:
    """OpenAI's error body, or on /v1/messages Anthropic's."""
    if path.startswith(MESSAGES):
        anthropic = {"type": _ANTHROPIC_ERRORS.get(status, "api_error"), "message": message}
        return JSONResponse({"type": "error", "error": anthropic}, status_code=status)
    return JSONResponse(error_body(message, kind, param, code), status_code=status)


def _add_error_handlers(app: FastAPI, service: Service) -> None:
    def counted(
        request: Request,
        status: int,
        message: str,
        kind: str,
        param: str | None = None,
        code: str | None = None,
    ) -> JSONResponse:
        """The error response, counted, and its reason in the server's log."""
        service.metrics.requests.labels("rejected" if status < 500 else "error").inc()
        where = f" (param {param})" if param else ""
        log.warning("%s %s refused with %d%s: %s", request.method, request.url.path, status, where, message)
        return _error(status, message, kind, param, code, request.url.path)

    @app.exception_handler(RequestValidationError)
    async def invalid_body(request: Request, exc: RequestValidationError) -> JSONResponse:
        first = exc.errors()[0] if exc.errors() else {}
        if first.get("type") == "json_invalid":  # its loc is a character offset, not a field
            offset = first.get("loc", ("body", "?"))[-1]
            message = f"the body is not valid JSON: {first.get('msg', '')} (at character {offset})"
            return counted(request, 400, message, "invalid_request_error")
        where = ".".join(str(p) for p in first.get("loc", ())[1:])
        message = f"{where}: {first.get('msg', 'invalid request')}" if where else str(first.get("msg", exc))
        return counted(request, 400, message, "invalid_request_error", where or None)

    @app.exception_handler(RequestError)
    async def bad_request(request: Request, exc: RequestError) -> JSONResponse:
        return counted(request, 400, str(exc), "invalid_request_error", exc.param)

    @app.exception_handler(ValueError)
    async def bad_value(request: Request, exc: ValueError) -> JSONResponse:
        return counted(request, 400, str(exc), "invalid_request_error")

    @app.exception_handler(UnknownModel)
    async def unknown_model(request: Request, exc: UnknownModel) -> JSONResponse:
        return counted(request, 404, str(exc), "invalid_request_error", "model", "model_not_found")

    @app.exception_handler(UnknownResponse)
    async def unknown_response(request: Request, exc: UnknownResponse) -> JSONResponse:
        return counted(request, 404, str(exc), "invalid_request_error", exc.param, "response_not_found")

    @app.exception_handler(QueueFull)
    async def queue_full(request: Request, exc: QueueFull) -> JSONResponse:
        return counted(request, 503, str(exc), "server_overloaded")

    @app.exception_handler(GenerationFailed)
    async def failed(request: Request, exc: GenerationFailed) -> JSONResponse:
        return counted(request, 400, f"generation failed: {exc}", "invalid_request_error")

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        response = counted(request, exc.status_code, str(exc.detail), kind)
        response.headers.update(exc.headers or {})
        if exc.status_code == 405:  # Allow: the methods of every route of this path, not the first's
            response.headers["Allow"] = ", ".join(sorted(_methods(app, request)))
        return response


def _methods(app: FastAPI, request: Request) -> set[str]:
    methods: set[str] = set()
    for route in app.routes:
        match, _ = route.matches(request.scope)
        if match != Match.NONE:
            methods |= getattr(route, "methods", None) or set()
    return methods


PROTECTED = "/v1/"  # what the API key guards, as vLLM: /health, /metrics and the docs stay open


class _Guard:
    """ASGI middleware: the API key (the /v1/ routes) and the body size limit."""

    def __init__(self, app: ASGIApp, api_key: str | None, max_body_bytes: int) -> None:
        self.app = app
        self.api_key = api_key
        self.max_body_bytes = max_body_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", [])}
        if self.api_key is not None and scope["path"].startswith(PROTECTED) and not self._allowed(headers):
            message = "invalid or missing API key (Authorization: Bearer KEY, or x-api-key: KEY)"
            reply = _error(401, message, "authentication_error", code="invalid_api_key", path=scope["path"])
            return await reply(scope, receive, send)
        length = headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > self.max_body_bytes:
            return await _too_large(self.max_body_bytes)(scope, receive, send)
        return await self.app(scope, _limited(receive, self.max_body_bytes), send)

    def _allowed(self, headers: dict[str, str]) -> bool:
        """The key as OpenAI's clients send it (Authorization: Bearer) or Anthropic's (x-api-key)."""
        assert self.api_key is not None
        bearer = headers.get("authorization", "").encode()
        key = headers.get("x-api-key", "").encode()
        return hmac.compare_digest(bearer, f"Bearer {self.api_key}".encode()) or hmac.compare_digest(
            key, self.api_key.encode()
        )


def _too_large(limit: int) -> JSONResponse:
    return JSONResponse(
        error_body(f"the request body is over {limit} bytes", "invalid_request_error"), status_code=413
    )


def _limited(receive: Receive, limit: int) -> Callable[[], Awaitable[Message]]:
    """A receive that fails a chunked body (no content-length) once it passes the limit: an HTTP
    error, which FastAPI passes on as it is (any other error while reading a body becomes a 400)."""
    seen = 0

    async def limited_receive() -> Message:
        nonlocal seen
        message = await receive()
        if message["type"] == "http.request":
            seen += len(message.get("body", b""))
            if seen > limit:
                raise StarletteHTTPException(413, f"the request body is over {limit} bytes")
        return message

    return limited_receive
