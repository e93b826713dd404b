"""What the server answers, as pydantic models for its OpenAPI document (`/openapi.json`).

The routes build their bodies directly (weft/server/completions.py, chat.py); these models only
describe them, and the test suite checks every body it receives against the document they make
(tests/test_server.py). Streams (`stream: true`) are `text/event-stream` of the same objects as
chunks.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class CompletionLogprobs(BaseModel):
    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None] | None
    text_offset: list[int]


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None
    finish_reason: Literal["stop", "length"] | None
    stop_reason: int | str | None = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage


class FunctionCall(BaseModel):
    name: str
    arguments: str  # JSON text


class ToolCall(BaseModel):
    id: str
    type: Literal["function"]
    function: FunctionCall


class AssistantMessage(BaseModel):
    role: Literal["assistant"]
    content: str | None
    refusal: str | None = None
    tool_calls: list[ToolCall] | None = None
    reasoning_content: str | None = None  # the reasoning section, where the model has one (vLLM's name)


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    content: list[TokenLogprob] | None
    refusal: Any = None


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None
    finish_reason: Literal["stop", "length", "tool_calls"] | None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class ModelCard(BaseModel):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str
    max_model_len: int


class ModelList(BaseModel):
    object: Literal["list"]
    data: list[ModelCard]


class Health(BaseModel):
    status: Literal["ok"]


def ok(model: type[BaseModel], stream: bool = False) -> dict[str, Any]:
    """The 200 entry of a route's `responses`: `model` as JSON (and, with `stream`, the
    server-sent events of a streamed request)."""
    entry: dict[str, Any] = {"model": model, "description": f"a {model.__name__}"}
    if stream:
        entry["content"] = {"text/event-stream": {"schema": {"type": "string"}}}
        entry["description"] += "; with stream: true, server-sent events of its chunks, then [DONE]"
    return entry
