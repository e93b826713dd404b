"""The OpenAI request bodies weft serves, as pydantic models, and their translation to
`SamplingParams`.

Fields follow the OpenAI API; the extras are named as vLLM names them (top_k, min_p,
repetition_penalty, stop_token_ids, ignore_eos, min_tokens, prompt_logprobs,
include_stop_str_in_output, skip_special_tokens, structured_outputs and the legacy guided_*), and
weft's own `speculative` (false: this request does not draft where the server speculates) and
`smc` (sequential Monte Carlo over constrained particles; not streamed).
Unknown top-level fields are ignored, as OpenAI-compatible servers do, except names that look like
a constraint (`guided_*`): a constraint weft does not understand is an error, never silently
unconstrained output. So is any unknown key inside `structured_outputs`.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any, Literal

import torch
from pydantic import BaseModel, ConfigDict, Field, model_validator

from weft.params import LogitsProcessor, ParamError, SamplingParams
from weft.schema_objects import JsonSchemaMode

GUIDED_FIELDS = ("guided_json", "guided_regex", "guided_choice", "guided_grammar")
# guided_* fields of other servers that choose how, not what: accepted and ignored
GUIDED_OPTIONS = ("guided_decoding_backend", "guided_whitespace_pattern")


class RequestError(ValueError):
    """A request weft cannot serve; `param` names the offending field."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    """Every error's body, as OpenAI's: `{"error": {"message", "type", "param", "code"}}`."""

    error: ErrorDetail


class StructuredOutputs(BaseModel):
    model_config = ConfigDict(extra="forbid")

    json_: Any = Field(default=None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None


class SMCRequest(BaseModel):
    """weft's `smc`: sequential Monte Carlo over constrained particles (`weft.params.SMCParams`)."""

    model_config = ConfigDict(extra="forbid")

    num_particles: int = 16
    ess_threshold: float = 0.5
    resampling: Literal["systematic", "stratified", "multinomial"] = "systematic"
    output: Literal["sample", "weighted"] = "sample"
    end_of_text: bool = True


class StreamOptions(BaseModel):
    include_usage: bool = False


class _Common(BaseModel):
    """Fields shared by completions and chat completions."""

    model_config = ConfigDict(extra="allow", populate_by_name=True)

    model: str | None = None
    n: int = 1
    temperature: float | None = None
    top_p: float | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    # extras, as vLLM names them
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    structured_outputs: StructuredOutputs | None = None
    speculative: bool = True  # weft's: False, this request never drafts where the server speculates
    smc: SMCRequest | None = None  # weft's: sequential Monte Carlo over constrained particles
    guided_json: Any = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None

    @model_validator(mode="after")
    def _no_unknown_constraint(self) -> _Common:
        for name in self.model_extra or {}:
            if name.startswith("guided_") and name not in GUIDED_OPTIONS:
                raise ValueError(
                    f"unknown constraint field {name!r}; weft understands {', '.join(GUIDED_FIELDS)} "
                    "and structured_outputs {json, regex, choice, grammar}"
                )
        return self

    def constraint(self) -> dict[str, Any]:
        """The one output constraint of the request, as SamplingParams fields."""
        found: dict[str, Any] = {}
        for field, value, _ in self._given_constraints():
            found[field] = json.loads(value) if field == "json_schema" and isinstance(value, str) else value
        return found

    def constraint_field(self) -> str | None:
        """The request's name for its constraint (`guided_json`, `structured_outputs.regex`, ...)."""
        given = self._given_constraints()
        return given[0][2] if given else None

    def _given_constraints(self) -> list[tuple[str, Any, str]]:
        """(SamplingParams field, value, the request's name) of each constraint given: at most one."""
        so = self.structured_outputs
        candidates = [
            ("json_schema", self.guided_json, "guided_json"),
            ("regex", self.guided_regex, "guided_regex"),
            ("choice", self.guided_choice, "guided_choice"),
            ("grammar", self.guided_grammar, "guided_grammar"),
        ]
        if so is not None:
            candidates += [
                ("json_schema", so.json_, "structured_outputs.json"),
                ("regex", so.regex, "structured_outputs.regex"),
                ("choice", so.choice, "structured_outputs.choice"),
                ("grammar", so.grammar, "structured_outputs.grammar"),
            ]
        given = [(field, value, name) for field, value, name in candidates if value is not None]
        if len(given) > 1:
            raise RequestError(
                f"at most one output constraint, got {', '.join(n for _, _, n in given)}", given[1][2]
            )
        return given

    def sampling_fields(self, max_tokens: int | None, vocab_size: int) -> dict[str, Any]:
        fields: dict[str, Any] = {
            "n": self.n,
            "temperature": 1.0 if self.temperature is None else self.temperature,
            "top_p": 1.0 if self.top_p is None else self.top_p,
            "stop": self.stop,
            "seed": self.seed,
            "max_tokens": max_tokens,
            "presence_penalty": self.presence_penalty,
            "frequency_penalty": self.frequency_penalty,
            "top_k": self.top_k or 0,
            "min_p": self.min_p or 0.0,
            "repetition_penalty": 1.0 if self.repetition_penalty is None else self.repetition_penalty,
            "stop_token_ids": self.stop_token_ids,
            "ignore_eos": self.ignore_eos,
            "min_tokens": self.min_tokens,
            "include_stop_str_in_output": self.include_stop_str_in_output,
            "skip_special_tokens": self.skip_special_tokens,
            "speculative": self.speculative,
        }
        if self.logit_bias:
            fields["logits_processors"] = [logit_bias_processor(self.logit_bias, vocab_size)]
        if self.smc is not None:
            if self.stream:
                raise RequestError("smc cannot be streamed (particles are weighed to the end)", "stream")
            fields["smc"] = self.smc.model_dump()
        return fields


class CompletionRequest(_Common):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16
    best_of: int | None = None
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None
    prompt_logprobs: int | None = None

    def prompts(self) -> list[str | list[int]]:
        prompt = self.prompt
        if isinstance(prompt, str):
            return [prompt]
        if not prompt:
            raise RequestError("prompt is empty", "prompt")
        if all(isinstance(p, int) for p in prompt):
            return [list(prompt)]  # type: ignore[arg-type]
        return list(prompt)  # type: ignore[arg-type]

    def sampling_params(
        self, vocab_size: int, json_schema_mode: JsonSchemaMode = JsonSchemaMode.CLOSED
    ) -> SamplingParams:
        if self.suffix:
            raise RequestError("suffix is not supported", "suffix")
        prompt_logprobs = self.prompt_logprobs
        if self.echo and self.logprobs is not None:
            prompt_logprobs = max(prompt_logprobs or 0, self.logprobs)
        constraint = self.constraint()
        return checked_params(
            lambda: SamplingParams(
                **self.sampling_fields(self.max_tokens, vocab_size),
                best_of=self.best_of,
                logprobs=self.logprobs,
                prompt_logprobs=prompt_logprobs,
                json_schema_mode=json_schema_mode,
                **constraint,
            ),
            _constraint_names(constraint, self.constraint_field()),
        )


class ResponseFormat(BaseModel):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: dict[str, Any] | None = None


class FunctionDef(BaseModel):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None  # OpenAI's strict mode for the arguments (weft/schema_objects.py)


class Tool(BaseModel):
    type: Literal["function"] = "function"
    function: FunctionDef


class NamedToolChoice(BaseModel):
    type: Literal["function"] = "function"
    function: dict[str, str]


# OpenAI's reasoning efforts as thinking budgets (tokens of the thinking section)
EFFORT_BUDGETS = {"minimal": 0, "low": 1024, "medium": 4096, "high": 16384}


class ChatCompletionRequest(_Common):
    messages: list[dict[str, Any]] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    response_format: ResponseFormat | None = None
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None  # e.g. {"enable_thinking": false}
    # the thinking section's budget in tokens (weft's), or OpenAI's effort for one (`EFFORT_BUDGETS`)
    reasoning_effort: Literal["minimal", "low", "medium", "high"] | None = None
    max_reasoning_tokens: int | None = Field(default=None, ge=0)

    def thinking_budget_tokens(self) -> int | None:
        """The most tokens the reply's thinking section may take (None: no limit)."""
        if self.max_reasoning_tokens is not None:
            return self.max_reasoning_tokens
        return None if self.reasoning_effort is None else EFFORT_BUDGETS[self.reasoning_effort]

    def sampling_params(
        self, vocab_size: int, constraint: dict[str, Any], constraint_field: str | None = None
    ) -> SamplingParams:
        """`constraint_field`: the request's name for the constraint (`response_format`, ...)."""
        max_tokens = self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
        if self.top_logprobs is not None and not self.logprobs:
            raise RequestError("top_logprobs needs logprobs: true", "top_logprobs")
        renames = _constraint_names(constraint, constraint_field)
        renames["logprobs"] = "top_logprobs"
        if self.max_completion_tokens is not None:
            renames["max_tokens"] = "max_completion_tokens"
        return checked_params(
            lambda: SamplingParams(
                **self.sampling_fields(max_tokens, vocab_size),
                logprobs=(self.top_logprobs or 0) if self.logprobs else None,
                **constraint,
            ),
            renames,
        )


_CONSTRAINT_FIELDS = ("json_schema", "json_object", "regex", "grammar", "choice", "grammar_syntax")


def _constraint_names(constraint: dict[str, Any], field: str | None) -> dict[str, str]:
    """SamplingParams' constraint fields -> the request's name for the constraint."""
    return {name: field for name in _CONSTRAINT_FIELDS if name in constraint} if field else {}


_SMC_FIELDS = {name: f"smc.{name}" for name in SMCRequest.model_fields}


def checked_params(make: Callable[[], SamplingParams], renames: dict[str, str]) -> SamplingParams:
    """`make()`, with a SamplingParams field's error (`SamplingParams.max_tokens must be ...`)
    turned into a RequestError naming the request's own field, in `param` and in the message
    (`renames`: SamplingParams' name -> the request's, where they differ)."""
    try:
        return make()
    except RequestError:  # the request's own fields, checked on the way (logit_bias, ...)
        raise
    except ParamError as exc:
        field = renames.get(exc.field, _SMC_FIELDS.get(exc.field, exc.field))
        raise RequestError(f"{field} {exc.detail}", field) from None
    except ValueError as exc:  # not one field's: several constraints given
        raise RequestError(str(exc)) from None


def logit_bias_processor(bias: dict[str, float], vocab_size: int) -> LogitsProcessor:
    """The OpenAI logit_bias (token id as a string -> a bias in [-100, 100]) as a logits processor."""
    ids, values = [], []
    for key, value in bias.items():
        try:
            token = int(key)
        except ValueError:
            raise RequestError(f"logit_bias keys must be token ids, got {key!r}", "logit_bias") from None
        if not 0 <= token < vocab_size:
            raise RequestError(f"logit_bias token {token} is outside the vocabulary", "logit_bias")
        if not -100.0 <= value <= 100.0:
            raise RequestError(f"logit_bias values must be in [-100, 100], got {value}", "logit_bias")
        ids.append(token)
        values.append(value)
    index, delta = torch.tensor(ids), torch.tensor(values)

    def apply_logit_bias(token_ids: list[int], logits: torch.Tensor) -> torch.Tensor:
        logits[index.to(logits.device)] += delta.to(logits.device)
        return logits

    return apply_logit_bias
