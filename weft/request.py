"""The engine-internal request: mutable state of one sequence being generated."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from enum import IntEnum, StrEnum

from weft.params import SamplingParams


class FinishReason(StrEnum):
    STOP = "stop"  # EOS, a stop token, a stop string, or a finished grammar
    LENGTH = "length"  # max_tokens or max_model_len reached
    ABORT = "abort"
    ERROR = "error"  # this request failed (for example its grammar); the batch went on


class RequestStatus(IntEnum):
    """Ordered so that every status >= FINISHED_STOPPED is final."""

    WAITING = 0
    RUNNING = 1
    PREEMPTED = 2
    FINISHED_STOPPED = 3
    FINISHED_LENGTH = 4
    FINISHED_ABORTED = 5
    FINISHED_ERROR = 6

    @property
    def is_finished(self) -> bool:
        return self >= RequestStatus.FINISHED_STOPPED


FINISHED_STATUS = {
    FinishReason.STOP: RequestStatus.FINISHED_STOPPED,
    FinishReason.LENGTH: RequestStatus.FINISHED_LENGTH,
    FinishReason.ABORT: RequestStatus.FINISHED_ABORTED,
    FinishReason.ERROR: RequestStatus.FINISHED_ERROR,
}


@dataclass(slots=True, eq=False)
class Request:
    """One sequence. `token_ids` holds the prompt followed by the output; `num_computed_tokens`
    counts the leading tokens whose KV entries are in the cache, and catches up with `num_tokens`.
    There is no prefill or decode mode: a prompt, a resumed preempted request and tokens appended
    without sampling are all simply tokens not yet computed."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    eos_token_ids: frozenset[int]
    seed: int  # the request's seed, or one drawn for it: randomness is keyed by (seed, position)
    prompt: str | None = None
    token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: FinishReason | None = None
    stop_reason: str | int | None = None
    error: str | None = None
    num_cached_prompt_tokens: int = 0
    num_preemptions: int = 0
    arrival_time: float = field(default_factory=time.monotonic)

    def __post_init__(self) -> None:
        if not self.token_ids:
            self.token_ids = list(self.prompt_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - len(self.prompt_token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[len(self.prompt_token_ids) :]

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    def finish(
        self, reason: FinishReason, stop_reason: str | int | None = None, error: str | None = None
    ) -> None:
        self.status = FINISHED_STATUS[reason]
        self.finish_reason = reason
        self.stop_reason = stop_reason
        self.error = error


def check_stop(request: Request, max_model_len: int) -> tuple[FinishReason, int | None] | None:
    """Token-level stop rules for the last token of `request`, as (reason, stop token) or None.
    A pure query: it changes nothing."""
    params = request.params
    num_output = request.num_output_tokens
    if num_output >= params.min_tokens and num_output > 0:
        last = request.token_ids[-1]
        if last in params.stop_token_ids:  # type: ignore[operator]
            return FinishReason.STOP, last
        if not params.ignore_eos and last in request.eos_token_ids:
            return FinishReason.STOP, None
    if params.max_tokens is not None and num_output >= params.max_tokens:
        return FinishReason.LENGTH, None
    if request.num_tokens >= max_model_len:
        return FinishReason.LENGTH, None
    return None
