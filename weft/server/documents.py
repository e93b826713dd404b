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
    # where the reply has a thinking section: {"reasoning_tokens": n} (chat completions)
    completion_tokens_details: dict[str, int] | None = None


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
    log_weight: float | None = None  # with smc: the particle's normalized log-weight (null: zero)


class SMCRunSummary(BaseModel):
    """weft's `smc` in a response: one per run (per prompt, `n` of them)."""

    log_marginal: float | None  # log P(the model produces a string of the language); null: zero
    num_resampling_steps: int
    num_particles: int


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage
    smc: list[SMCRunSummary] | None = None  # with smc


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
    log_weight: float | None = None  # with smc: the particle's normalized log-weight (null: zero)


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    smc: list[SMCRunSummary] | None = None  # with smc


class OutputText(BaseModel):
    type: Literal["output_text"]
    text: str
    annotations: list[Any]
    logprobs: list[Any]


class ReasoningText(BaseModel):
    type: Literal["reasoning_text"]
    text: str


ItemStatus = Literal["in_progress", "completed", "incomplete"]


class OutputMessage(BaseModel):
    type: Literal["message"]
    id: str
    status: ItemStatus
    role: Literal["assistant"]
    content: list[OutputText]


class ReasoningItem(BaseModel):
    """The reasoning section of a reasoning model's reply, as text (`content`); no summary."""

    type: Literal["reasoning"]
    id: str
    summary: list[Any]
    content: list[ReasoningText]
    status: ItemStatus


class FunctionCallItem(BaseModel):
    type: Literal["function_call"]
    id: str
    call_id: str
    name: str
    arguments: str  # JSON text
    status: ItemStatus


class InputTokensDetails(BaseModel):
    cached_tokens: int  # prompt tokens whose KV came from weft's prefix cache
    cache_write_tokens: int


class OutputTokensDetails(BaseModel):
    reasoning_tokens: int  # the reasoning item's text, tokenized


class ResponseUsage(BaseModel):
    input_tokens: int
    input_tokens_details: InputTokensDetails
    output_tokens: int
    output_tokens_details: OutputTokensDetails
    total_tokens: int


class ResponseError(BaseModel):
    code: str
    message: str


class IncompleteDetails(BaseModel):
    reason: Literal["max_output_tokens"]


class ResponseObject(BaseModel):
    """OpenAI's Response object; with stream: true, server-sent events named by their `type`
    (response.created, response.output_text.delta, ..., response.completed)."""

    id: str
    object: Literal["response"]
    created_at: int
    status: Literal["completed", "incomplete", "in_progress", "failed"]
    completed_at: int | None
    error: ResponseError | None
    incomplete_details: IncompleteDetails | None
    instructions: str | None
    max_output_tokens: int | None
    model: str
    output: list[ReasoningItem | OutputMessage | FunctionCallItem]
    parallel_tool_calls: bool
    previous_response_id: str | None
    reasoning: dict[str, Any]
    store: bool
    temperature: float
    top_p: float
    text: dict[str, Any]
    tool_choice: str | dict[str, Any]
    tools: list[dict[str, Any]]
    truncation: Literal["disabled"]
    usage: ResponseUsage | None = None  # once finished
    user: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    metadata: dict[str, str]
    service_tier: str
    background: bool


class DeletedResponse(BaseModel):
    id: str
    object: Literal["response.deleted"]
    deleted: bool


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


# one server-sent event (OpenAPI 3.1 describes each event of a text/event-stream by `schema`)
SERVER_SENT_EVENT = {
    "type": "object",
    "properties": {"event": {"type": "string"}, "data": {"type": "string"}},
    "required": ["data"],
}


def ok(model: type[BaseModel], stream: str | None = None) -> dict[str, Any]:
    """The 200 entry of a route's `responses`: `model` as JSON (and, with `stream` saying what
    they are, the server-sent events of a streamed request)."""
    entry: dict[str, Any] = {"model": model, "description": f"a {model.__name__}"}
    if stream:
        entry["content"] = {"text/event-stream": {"schema": SERVER_SENT_EVENT}}
        entry["description"] += f"; with stream: true, server-sent events: {stream}"
    return entry
