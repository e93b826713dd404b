"""OpenAI response bodies built from weft's outputs: completions, chat completions, their
streaming chunks, logprobs in both shapes, usage, and errors."""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from typing import Any

from weft.outputs import CompletionOutput, Logprob, PositionLogprobs, RequestOutput

FINISH_REASONS = {"stop": "stop", "length": "length", "abort": "stop", "error": "stop"}


def error_body(message: str, kind: str, param: str | None = None, code: str | int | None = None) -> dict:
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def sse(payload: dict[str, Any] | str) -> str:
    """One server-sent event."""
    return f"data: {payload if isinstance(payload, str) else json.dumps(payload)}\n\n"


class ChunkWriter:
    """The SSE events of one stream: the fields every chunk repeats are serialized once."""

    def __init__(self, fields: dict[str, Any], service: Any) -> None:
        fields = {**fields, "model": service.model_name}
        self._head = "data: " + json.dumps(fields)[:-1] + ', "choices": ['

    def choice(self, choice: dict[str, Any]) -> str:
        return f"{self._head}{json.dumps(choice)}]}}\n\n"

    def usage(self, prompt_tokens: int, completion_tokens: int) -> str:
        return f'{self._head}], "usage": {json.dumps(usage(prompt_tokens, completion_tokens))}}}\n\n'


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, Any]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def finite(value: float) -> float | None:
    """A float as JSON takes it: -inf (a weight of zero) as null."""
    return value if math.isfinite(value) else None


def smc_runs(output: RequestOutput) -> list[dict[str, Any]]:
    """weft's `smc` of a response: per run, the log-marginal estimate (null: no particle reached
    the language) and the resampling steps."""
    return [
        {
            "log_marginal": finite(run.log_marginal),
            "num_resampling_steps": run.num_resampling_steps,
            "num_particles": run.num_particles,
        }
        for run in output.smc or []
    ]


def finish_reason(completion: CompletionOutput) -> str | None:
    return None if completion.finish_reason is None else FINISH_REASONS[completion.finish_reason]


def _top(position: PositionLogprobs, num_top: int) -> list[tuple[int, Logprob]]:
    """The top `num_top` of a position, most likely first (the chosen token is among them only
    when its rank is within the top)."""
    return sorted(((t, lp) for t, lp in position.items() if lp.rank <= num_top), key=lambda x: x[1].rank)[
        :num_top
    ]


def completion_logprobs(
    token_ids: list[int],
    positions: list[PositionLogprobs | None],
    num_top: int,
    first_offset: int,
    offsets: list[int] | None = None,
    token_text: Callable[[int], str] = str,
) -> dict[str, list[Any]]:
    """The legacy completions shape: tokens, token_logprobs, top_logprobs, text_offset. Offsets
    are `offsets` shifted by `first_offset`, or, without them, each token's text laid end to end."""
    tokens: list[str] = []
    values: list[float | None] = []
    tops: list[dict[str, float] | None] = []
    text_offset: list[int] = []
    position_offset = first_offset
    for i, (token, position) in enumerate(zip(token_ids, positions, strict=True)):
        if position is None:  # the first prompt token: no logprob
            tokens.append(token_text(token))
            values.append(None)
            tops.append(None)
        else:
            chosen = position[token]
            tokens.append(chosen.decoded_token or "")
            values.append(chosen.logprob)
            tops.append({lp.decoded_token or "": lp.logprob for _, lp in _top(position, num_top)})
        text_offset.append(first_offset + offsets[i] if offsets is not None else position_offset)
        position_offset += len(tokens[-1])
    return {"tokens": tokens, "token_logprobs": values, "top_logprobs": tops, "text_offset": text_offset}


def _token_entry(lp: Logprob) -> dict[str, Any]:
    text = lp.decoded_token or ""
    return {"token": text, "logprob": lp.logprob, "bytes": list(text.encode("utf-8", "surrogatepass"))}


def chat_logprobs(token_ids: list[int], positions: list[PositionLogprobs], num_top: int) -> dict[str, Any]:
    """The chat shape: {"content": [{token, logprob, bytes, top_logprobs: [...]}]}."""
    content = []
    for token, position in zip(token_ids, positions, strict=False):
        entry = _token_entry(position[token])
        entry["top_logprobs"] = [_token_entry(lp) for _, lp in _top(position, num_top)]
        content.append(entry)
    return {"content": content, "refusal": None}
