"""What generation returns: per-token logprobs, completions and request outputs."""

from __future__ import annotations

import secrets
import string
import uuid
from dataclasses import dataclass, field
from typing import Any

import torch

from weft.logprob_records import LazyPositions
from weft.logprob_records import Logprob as Logprob  # re-exported: weft.outputs is its public home
from weft.logprob_records import PositionLogprobs as PositionLogprobs


def new_call_id(short: bool = False) -> str:
    """A tool call's id: OpenAI's `call_` and 24 hex digits, or (`short`: all Mistral's templates
    accept) 9 letters and digits."""
    if short:
        return "".join(secrets.choice(_ALPHANUMERIC) for _ in range(9))
    return f"call_{uuid.uuid4().hex[:24]}"


_ALPHANUMERIC = string.ascii_letters + string.digits


@dataclass(slots=True)
class ToolCall:
    """One call: the function's name and its arguments as JSON text (OpenAI's `arguments`)."""

    name: str
    arguments: str
    id: str = field(default_factory=new_call_id)

    def to_openai(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }


@dataclass(slots=True)
class AssistantMessage:
    """A reply read as OpenAI's assistant message."""

    content: str | None
    reasoning_content: str | None = None
    tool_calls: list[ToolCall] = field(default_factory=list)

    def to_openai(self) -> dict[str, Any]:
        message: dict[str, Any] = {"role": "assistant", "content": self.content, "refusal": None}
        if self.reasoning_content is not None:
            message["reasoning_content"] = self.reasoning_content
        if self.tool_calls:
            message["tool_calls"] = [c.to_openai() for c in self.tool_calls]
        return message


class CompletionOutput:
    """One completion of a request. `logprobs` is built the first time it is read (see
    `weft.logprob_records`); everything else is plain data."""

    _FIELDS = (
        "index", "text", "token_ids", "finish_reason", "stop_reason", "cumulative_logprob", "logprobs",
        "error", "constraint_logmass", "text_offsets", "forced", "message", "log_weight",
    )  # fmt: skip  # in the order of the constructor's arguments
    __slots__ = tuple(sorted(name if name != "logprobs" else "_logprobs" for name in _FIELDS))

    def __init__(
        self,
        index: int,
        text: str,
        token_ids: list[int],
        finish_reason: str | None = None,
        stop_reason: str | int | None = None,
        cumulative_logprob: float | None = None,
        logprobs: list[PositionLogprobs] | LazyPositions | None = None,
        error: str | None = None,
        constraint_logmass: list[float] | None = None,
        text_offsets: list[int] | None = None,
        forced: list[bool] | None = None,
        message: AssistantMessage | None = None,
        log_weight: float | None = None,
    ) -> None:
        self.index, self.text, self.token_ids = index, text, token_ids
        self.finish_reason, self.stop_reason = finish_reason, stop_reason
        self.cumulative_logprob = cumulative_logprob
        self._logprobs = logprobs
        self.error = error
        # With logprobs: per generated position, the log of the model's probability mass on the
        # tokens the constraint allowed (0.0 for unconstrained requests).
        self.constraint_logmass = constraint_logmass
        # With logprobs: where each token's text starts in the completion's full text (as in the
        # OpenAI API's text_offset; a character split over tokens starts at the token that ends it).
        self.text_offsets = text_offsets
        # With logprobs: per generated position, True where the grammar forced the token
        # (fast-forward) instead of it being sampled. A forced token's logprobs are the model's own
        # (raw) distribution, computed in the step after it was appended, like a prompt token's.
        self.forced = forced
        # From LLM.chat: the reply read as an assistant message (content, reasoning_content and the
        # tool calls it made), where tools were given or the template has a reasoning section.
        self.message = message
        # With SamplingParams.smc: the log of this particle's normalized weight in its run.
        self.log_weight = log_weight

    @property
    def logprobs(self) -> list[PositionLogprobs] | None:
        """Per generated position: token id -> Logprob, the chosen token first, then the top-n."""
        value = self._logprobs
        if type(value) is LazyPositions:
            value = self._logprobs = value.build()
        return value  # type: ignore[return-value]

    @logprobs.setter
    def logprobs(self, value: list[PositionLogprobs] | None) -> None:
        self._logprobs = value

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def _fields(self) -> tuple[tuple[str, object], ...]:
        return tuple((name, getattr(self, name)) for name in self._FIELDS)

    def __repr__(self) -> str:
        return f"CompletionOutput({', '.join(f'{k}={v!r}' for k, v in self._fields())})"

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, CompletionOutput):
            return NotImplemented
        return self._fields() == other._fields()

    __hash__ = None  # type: ignore[assignment]  # mutable, like the dataclass it was

    def __reduce__(self) -> tuple[type[CompletionOutput], tuple[object, ...]]:
        """Pickled and copied with its logprobs built (a pending span would carry the tokenizer)."""
        return CompletionOutput, tuple(value for _, value in self._fields())


@dataclass(frozen=True, slots=True)
class SpeculationCounts:
    """How a request's speculation went: steps that verified drafts, the draft tokens verified, and
    those accepted (each accepted token is one forward saved)."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0

    @property
    def acceptance_rate(self) -> float:
        """The share of draft tokens accepted (0 with no drafts)."""
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Tokens gained per verifying step: 1 + the accepted drafts per draft (vLLM's definition)."""
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 1.0

    def __add__(self, other: SpeculationCounts) -> SpeculationCounts:
        return SpeculationCounts(
            self.num_drafts + other.num_drafts,
            self.num_draft_tokens + other.num_draft_tokens,
            self.num_accepted_tokens + other.num_accepted_tokens,
        )


@dataclass(frozen=True, slots=True)
class SMCRun:
    """One SMC run of a request (`SamplingParams.smc`; a request makes `n` of them)."""

    # log(mean final weight of the particles): an estimate of the log of the probability that the
    # model, unconstrained (at the sampling temperature), produces a string of the language
    log_marginal: float
    num_resampling_steps: int
    num_particles: int


@dataclass(slots=True)
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0
    # One entry per prompt token: None for the first, then the token and the top-k alternatives.
    prompt_logprobs: list[PositionLogprobs | None] | None = None
    # With speculative decoding: the request's drafts and accepted draft tokens, over its sequences.
    speculation: SpeculationCounts | None = None
    # With SamplingParams.smc, once finished: each run's log-marginal estimate and resampling steps
    # ("sample": completion i is run i's; "weighted": run r's particles are completions
    # r * num_particles .. (r + 1) * num_particles - 1).
    smc: list[SMCRun] | None = None


@dataclass(slots=True)
class BeamSearchSequence:
    """One finished beam: its generated tokens (the prompt not included), their text, the sum of
    their logprobs and its score (`cumulative_logprob / len(token_ids) ** length_penalty`)."""

    token_ids: list[int]
    text: str
    cumulative_logprob: float
    score: float
    finish_reason: str | None
    stop_reason: str | int | None = None


@dataclass(slots=True)
class BeamSearchOutput:
    """The finished beams of one prompt, best score first; `error` says why there are none."""

    sequences: list[BeamSearchSequence]
    error: str | None = None


@dataclass(frozen=True, slots=True)
class ChoiceScore:
    """One option scored after a prompt: the total logprob of its tokens, and each token's.

    `token_ids` are the tokens attributed to the option: those of `prompt + option` (tokenized as
    one text) from the first token that differs from the prompt's own tokens. When the tokenizer
    merges the end of the prompt with the start of the option, that merged token counts for the
    option, so `logprob` is that of the text from the merge point on."""

    text: str
    logprob: float
    token_ids: list[int]
    token_logprobs: list[float]


@dataclass(frozen=True, slots=True)
class LogprobsTensors:
    """Logprobs of the sampled rows that asked for them. Column 0 is the sampled token, columns
    1..k the top-k; `rows` names the batch row of each of the R rows."""

    token_ids: torch.Tensor  # [R, k+1] int64
    logprobs: torch.Tensor  # [R, k+1] float32
    ranks: torch.Tensor  # [R] int64, rank of the sampled token (1 = argmax)
    rows: tuple[int, ...]  # [R] the batch row of each row here
    constraint_logmass: torch.Tensor | None = None  # [R] float32, log of the mass the grammar allowed


@dataclass(frozen=True, slots=True)
class SamplerOutput:
    token_ids: torch.Tensor  # [B] int64, one sampled token per row
    logprobs: torch.Tensor | None  # [B] float32, the sampled token's logprob; None unless requested
    top_logprobs: LogprobsTensors | None = None
    errors: dict[int, str] = field(default_factory=dict)  # row -> why that row failed


@dataclass(slots=True)
class EngineStats:
    kv_blocks_total: int
    kv_blocks_used: int
    prefix_cache_hit_tokens: int
    prefix_cache_queried_tokens: int
    num_running: int  # sequences
    num_waiting: int
    num_preemptions: int
    num_requests_running: int = 0  # requests with a sequence in the running batch
    num_requests_waiting: int = 0  # the other requests in the engine
    extra: dict[str, float] = field(default_factory=dict)

    def as_dict(self) -> dict[str, float]:
        return {
            "kv_blocks_total": self.kv_blocks_total,
            "kv_blocks_used": self.kv_blocks_used,
            "prefix_cache_hit_tokens": self.prefix_cache_hit_tokens,
            "prefix_cache_queried_tokens": self.prefix_cache_queried_tokens,
            "num_running": self.num_running,
            "num_waiting": self.num_waiting,
            "num_preemptions": self.num_preemptions,
            "num_requests_running": self.num_requests_running,
            "num_requests_waiting": self.num_requests_waiting,
            **self.extra,
        }
