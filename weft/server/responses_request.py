"""The body of POST /v1/responses, checked field by field, and its translation to a chat request.

A Responses request is a chat request in another shape: `input` (a string, or items: messages,
earlier function calls and their outputs, reasoning) and `instructions` become the chat's messages,
function `tools` and `tool_choice` the chat's tools, `text.format` its `response_format`,
`max_output_tokens` its `max_completion_tokens`. Fields weft cannot honour are a 400 that names
them (`background`, `conversation`, `prompt`, images, ...), never dropped.
Fields that change nothing weft generates are taken as real clients send them (Codex CLI's
`client_metadata`, `reasoning.summary`, `include` entries that ask for the outputs of built-in
tools, which weft returns none of), and `include: ["reasoning.encrypted_content"]` is honoured
(reasoning items carry their thinking as opaque content, taken back on the next turn). Built-in
tools (`web_search`, ...) weft cannot run are left out of the prompt and named in the response's
`x-weft-warning` header and the server's log, unless `tool_choice` names one (a 400). The
sampling extras of weft's other endpoints (seed, top_k, min_p, repetition_penalty,
presence_penalty, frequency_penalty, stop, stop_token_ids, ignore_eos, min_tokens, logit_bias,
speculative) are taken here too.
"""

from __future__ import annotations

import re
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from weft.server.protocol import (
    EFFORT_BUDGETS,
    ChatCompletionRequest,
    FunctionDef,
    NamedToolChoice,
    RequestError,
    ResponseFormat,
    Tool,
)
from weft.server.responses_output import unseal

_ROLES = {"user": "user", "assistant": "assistant", "system": "system", "developer": "system"}
_TEXT_PARTS = ("input_text", "output_text")
_TOOL_KEYS = {"type", "name", "description", "parameters", "strict"}
SEALED_REASONING = "reasoning.encrypted_content"  # reasoning items carry it (responses_output.seal)
# `include` entries that ask for what built-in tools or image inputs produce: weft runs neither, so
# there is nothing to include; and the one weft honours
_EMPTY_INCLUDES = {
    SEALED_REASONING,
    "web_search_call.action.sources",
    "web_search_call.results",
    "file_search_call.results",
    "code_interpreter_call.outputs",
    "computer_call_output.output.image_url",
    "message.input_image.image_url",
}
_SUMMARIES = (None, "auto", "concise", "detailed")  # weft returns the thinking itself, no summary
_EXTRAS = (
    "seed",
    "top_k",
    "min_p",
    "repetition_penalty",
    "presence_penalty",
    "frequency_penalty",
    "stop",
    "stop_token_ids",
    "ignore_eos",
    "min_tokens",
    "logit_bias",
    "speculative",
)


class TextFormat(BaseModel):
    """`text.format`: plain text, any JSON object, or JSON that validates against `schema`."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True, strict=True)

    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    description: str | None = None
    strict: bool | None = None


class ResponseText(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    format: TextFormat | None = None
    verbosity: None = None  # a model cannot be told how verbose to be: any value is a 400


class ResponsesRequest(BaseModel):
    # strict: a field of the wrong JSON type is a 400, never coerced ("1" is not 1)
    model_config = ConfigDict(extra="allow", strict=True)

    model: str | None = None
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    text: ResponseText | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    stream: bool = False
    previous_response_id: str | None = None
    store: bool | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None  # weft reuses any cached prefix on its own
    service_tier: str | None = None
    truncation: str | None = None
    reasoning: dict[str, Any] | None = None
    include: list[str] | None = None
    client_metadata: dict[str, Any] | None = None  # a client's own bookkeeping (Codex CLI): not read
    background: bool | None = None
    stream_options: dict[str, Any] | None = None
    top_logprobs: int | None = None
    max_tool_calls: int | None = None
    # extras, as weft's other endpoints (and vLLM) name them
    seed: int | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    logit_bias: dict[str, float] | None = None
    speculative: bool = True

    def check_supported(self) -> None:
        """A 400 naming the first field weft cannot honour."""
        for name, why in self._unsupported():
            raise RequestError(f"{name}: {why}", name)

    def _unsupported(self) -> list[tuple[str, str]]:
        found = [
            (name, "unknown field; see docs/server.md for what /v1/responses takes")
            for name in self.model_extra or {}
        ]
        if self.background:
            found.append(("background", "background responses are not supported; leave it false"))
        unknown_includes = sorted(set(self.include or ()) - _EMPTY_INCLUDES)
        if unknown_includes:
            found.append(
                (
                    "include",
                    f"weft cannot add {', '.join(unknown_includes)}; it takes reasoning.encrypted_content "
                    "and entries for built-in tools' outputs, which it returns none of",
                )
            )
        if self.top_logprobs:
            found.append(
                ("top_logprobs", "logprobs are not returned by /v1/responses; use /v1/chat/completions")
            )
        if self.max_tool_calls is not None:
            found.append(("max_tool_calls", "not supported; parallel_tool_calls: false allows one call"))
        if self.truncation not in (None, "disabled"):
            found.append(("truncation", "only 'disabled': an input longer than the context is a 400"))
        if self.service_tier not in (None, "auto", "default"):
            found.append(("service_tier", "weft has one service tier: 'auto' or 'default'"))
        found += _reasoning_unsupported(self.reasoning or {})
        choice = self.tool_choice
        if isinstance(choice, dict) and choice.get("type") not in (None, "function"):
            found.append(("tool_choice", f"names a {choice.get('type')} tool, which weft does not run"))
        if self.stream_options and set(self.stream_options) - {"include_obfuscation"}:
            found.append(("stream_options", "only include_obfuscation (weft adds no obfuscation)"))
        return found

    @property
    def sealed_reasoning(self) -> bool:
        """Whether reasoning items carry `encrypted_content` (`include`), for a client that keeps
        nothing on the server (`store: false`) and hands them back next turn."""
        return SEALED_REASONING in (self.include or ())

    def dropped_tools(self) -> list[str]:
        """The types of the built-in tools weft leaves out of the prompt (it runs functions only)."""
        return sorted({str(t.get("type")) for t in self.tools or () if t.get("type") != "function"})

    @property
    def format(self) -> TextFormat | None:
        return self.text.format if self.text is not None else None

    def chat_request(self, messages: list[dict[str, Any]]) -> ChatCompletionRequest:
        """The chat request that generates this response's reply to `messages`."""
        extras = {name: getattr(self, name) for name in _EXTRAS}
        return ChatCompletionRequest(
            model=self.model,
            messages=messages,
            stream=self.stream,
            temperature=self.temperature,
            top_p=self.top_p,
            max_completion_tokens=self.max_output_tokens,
            tools=[_tool(t, i) for i, t in enumerate(self.tools or ()) if t.get("type") == "function"]
            or None,
            tool_choice=_tool_choice(self.tool_choice),
            parallel_tool_calls=self.parallel_tool_calls is not False,
            response_format=_response_format(self.format),
            reasoning_effort=(self.reasoning or {}).get("effort"),
            **extras,
        )

    def messages(self) -> list[dict[str, Any]]:
        """`input` as chat messages (`instructions` not included)."""
        if isinstance(self.input, str):
            return [{"role": "user", "content": self.input}]
        return InputItems().read(self.input)


class InputItems:
    """Input items -> chat messages: a function call joins the assistant message before it (or
    makes one), its output is a `tool` message, a reasoning item is the `reasoning_content` of the
    assistant message after it."""

    def __init__(self) -> None:
        self.messages: list[dict[str, Any]] = []
        self.reasoning: str | None = None
        self.names: dict[str, str] = {}  # call_id -> the function's name

    def read(self, items: list[dict[str, Any]]) -> list[dict[str, Any]]:
        for i, item in enumerate(items):
            kind = item.get("type", "message" if "role" in item else None)
            where = f"input[{i}]"
            if kind == "message":
                self._message(item, where)
            elif kind == "function_call":
                self._call(item, where)
            elif kind == "function_call_output":
                self._output(item, where)
            elif kind == "reasoning":
                self.reasoning = _reasoning_text(item, where)
            else:
                raise RequestError(
                    f"{where}: items of type {kind!r} are not supported; weft takes message, "
                    "function_call, function_call_output and reasoning items",
                    where,
                )
        return self.messages

    def _message(self, item: dict[str, Any], where: str) -> None:
        role = item.get("role")
        if role not in _ROLES:
            raise RequestError(
                f"{where}.role must be one of {', '.join(_ROLES)}, got {role!r}", f"{where}.role"
            )
        message: dict[str, Any] = {
            "role": _ROLES[role],
            "content": _text(item.get("content"), f"{where}.content"),
        }
        self._append(message)

    def _call(self, item: dict[str, Any], where: str) -> None:
        call_id, name, arguments = (_string(item, key, where) for key in ("call_id", "name", "arguments"))
        self.names[call_id] = name
        call = {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}
        last = self.messages[-1] if self.messages else None
        if last is not None and last["role"] == "assistant" and self.reasoning is None:
            last.setdefault("tool_calls", []).append(call)
        else:
            self._append({"role": "assistant", "content": None, "tool_calls": [call]})

    def _output(self, item: dict[str, Any], where: str) -> None:
        call_id = _string(item, "call_id", where)
        output = item.get("output")
        text = output if isinstance(output, str) else _text(output, f"{where}.output")
        message = {"role": "tool", "tool_call_id": call_id, "content": text}
        if call_id in self.names:
            message["name"] = self.names[call_id]
        self._append(message)

    def _append(self, message: dict[str, Any]) -> None:
        if message["role"] == "assistant" and self.reasoning is not None:
            message["reasoning_content"] = self.reasoning
            self.reasoning = None
        self.messages.append(message)


def _reasoning_unsupported(reasoning: dict[str, Any]) -> list[tuple[str, str]]:
    """What of `reasoning` weft cannot honour: an effort it has no budget for, a summary other than
    the ones it may leave empty, any other key."""
    found = []
    if reasoning.get("effort") not in (None, *EFFORT_BUDGETS):
        found.append(
            ("reasoning.effort", f"must be one of {', '.join(EFFORT_BUDGETS)}, got {reasoning['effort']!r}")
        )
    if reasoning.get("summary") not in _SUMMARIES:
        found.append(
            ("reasoning.summary", f"must be one of auto, concise, detailed, got {reasoning['summary']!r}")
        )
    for key in sorted(set(reasoning) - {"effort", "summary", "generate_summary"}):
        found.append((f"reasoning.{key}", "unknown field"))
    return found


def _string(item: dict[str, Any], key: str, where: str) -> str:
    value = item.get(key)
    if not isinstance(value, str):
        raise RequestError(f"{where}.{key} must be a string", f"{where}.{key}")
    return value


def _text(content: Any, where: str) -> str:
    """A message's content: a string, or text parts joined."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise RequestError(f"{where} must be a string or a list of text parts", where)
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in _TEXT_PARTS or not isinstance(part.get("text"), str):
            raise RequestError(
                f"{where}[{j}]: only input_text and output_text parts are supported (weft serves text "
                f"models), got {kind!r}",
                f"{where}[{j}]",
            )
        texts.append(part["text"])
    return "".join(texts)


def _reasoning_text(item: dict[str, Any], where: str) -> str:
    """A reasoning item's thinking: its text parts, or what weft sealed in its `encrypted_content`."""
    sealed = item.get("encrypted_content")
    if not item.get("content") and isinstance(sealed, str):
        text = unseal(sealed)
        if text is None:
            raise RequestError(
                f"{where}.encrypted_content was not written by weft; send the reasoning item weft returned",
                f"{where}.encrypted_content",
            )
        return text
    parts = item.get("content") or item.get("summary") or []
    if not isinstance(parts, list) or not all(
        isinstance(p, dict) and isinstance(p.get("text"), str) for p in parts
    ):
        raise RequestError(
            f"{where}: a reasoning item's content must be a list of {{type, text}} parts", where
        )
    return "".join(p["text"] for p in parts)


def _tool(tool: dict[str, Any], index: int) -> Tool:
    where = f"tools[{index}]"
    if tool.get("type") != "function":
        raise RequestError(
            f"{where}: only function tools are supported, got {tool.get('type')!r}", f"{where}.type"
        )
    unknown = set(tool) - _TOOL_KEYS
    if unknown:
        raise RequestError(f"{where}: unsupported keys {', '.join(sorted(unknown))}", where)
    if not isinstance(tool.get("name"), str) or not re.fullmatch(r"[A-Za-z0-9_.:-]{1,128}", tool["name"]):
        raise RequestError(
            f"{where}.name must be a function name (letters, digits, _ . : -)", f"{where}.name"
        )
    parameters = tool.get("parameters")
    if parameters is not None and not isinstance(parameters, dict):
        raise RequestError(f"{where}.parameters must be a JSON Schema object", f"{where}.parameters")
    strict = tool.get("strict")
    description = tool.get("description")
    return Tool(
        function=FunctionDef(
            name=tool["name"],
            description=description if isinstance(description, str) else None,
            parameters=parameters,
            strict=strict if isinstance(strict, bool) else None,
        )
    )


def _tool_choice(choice: str | dict[str, Any] | None) -> Any:
    if choice is None or choice in ("none", "auto", "required"):
        return choice
    if isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("name"), str):
        return NamedToolChoice(function={"name": choice["name"]})
    raise RequestError(
        'tool_choice must be none, auto, required or {"type": "function", "name": ...}', "tool_choice"
    )


def _response_format(fmt: TextFormat | None) -> ResponseFormat | None:
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return ResponseFormat(type="json_object")
    for key, value in (("schema", fmt.schema_), ("name", fmt.name)):
        if value is None:
            raise RequestError(f"text.format.{key} is required for json_schema", f"text.format.{key}")
    return ResponseFormat(
        type="json_schema", json_schema={"name": fmt.name, "schema": fmt.schema_, "strict": fmt.strict}
    )


# the chat request's names in its errors -> this request's
_RENAMED = {
    "max_completion_tokens": "max_output_tokens",
    "response_format": "text.format",
    "messages": "input",
}


def renamed(error: RequestError) -> RequestError:
    """A chat request's error, naming this request's fields."""
    message = re.sub(
        r"\b(max_completion_tokens|response_format)\b", lambda m: _RENAMED[m.group(1)], str(error)
    )
    return RequestError(message, _RENAMED.get(error.param or "", error.param))
