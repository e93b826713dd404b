"""POST /v1/completions: one engine request per prompt, streamed or collected."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from weft.outputs import CompletionOutput, RequestOutput
from weft.params import OutputKind
from weft.server.bodies import (
    ChunkWriter,
    completion_logprobs,
    finish_reason,
    finite,
    smc_runs,
    sse,
    usage,
)
from weft.server.engine_loop import RequestHandle, merge, now
from weft.server.protocol import CompletionRequest
from weft.server.service import GenerationFailed, Service


@dataclass(slots=True)
class _Prompt:
    text: str  # the prompt's text (decoded when it was given as token ids), for echo
    num_tokens: int = 0


class Completions:
    def __init__(self, service: Service) -> None:
        self.service = service

    async def start(self, body: CompletionRequest) -> tuple[CompletionRequest, list[RequestHandle], str]:
        """Validate and queue every prompt (all or none); raises for a bad request."""
        service = self.service
        service.check_model(body.model)
        params = body.sampling_params(service.vocab_size, service.json_schema_mode)
        kind = OutputKind.DELTA if body.stream else OutputKind.FINAL_ONLY
        if body.stream and params.num_samples > params.n:
            raise ValueError("best_of > n cannot be streamed (the best are known only at the end)")
        params = params.replace(output_kind=kind)
        service.check_limits(params)
        await service.validate_constraint(params, body.constraint_field())
        request_id = f"cmpl-{uuid.uuid4().hex}"
        handles = await service.add_all(request_id, body.prompts(), params)
        return body, handles, request_id

    async def respond(self, body: CompletionRequest, handles: list[RequestHandle], request_id: str) -> dict:
        by_prompt: dict[int, RequestOutput] = {}
        async for i, output in merge(h.outputs() for h in handles):
            if output.finished:
                by_prompt[i] = output
        finals = [by_prompt[i] for i in sorted(by_prompt)]
        choices = []
        for i, out in enumerate(finals):
            prompt = self._prompt(out)
            for c in out.outputs:  # n per prompt (n runs, or their particles, with smc)
                if c.error is not None:
                    raise GenerationFailed(c.error)
                choices.append(self._choice(body, out, c, prompt, i * len(out.outputs) + c.index))
        prompt_tokens = sum(len(o.prompt_token_ids) for o in finals)
        completion_tokens = sum(len(c.token_ids) for o in finals for c in o.outputs)
        self.service.count(prompt_tokens, completion_tokens)
        body_out = {
            "id": request_id,
            "object": "text_completion",
            "created": now(),
            "model": self.service.model_name,
            "choices": choices,
            "usage": usage(prompt_tokens, completion_tokens),
        }
        if body.smc is not None:
            body_out["smc"] = [run for out in finals for run in smc_runs(out)]
        return body_out

    def _prompt(self, out: RequestOutput) -> _Prompt:
        text = out.prompt if out.prompt is not None else self.service.tokenizer.decode(out.prompt_token_ids)
        return _Prompt(text, len(out.prompt_token_ids))

    def _choice(
        self, body: CompletionRequest, out: RequestOutput, c: CompletionOutput, prompt: _Prompt, index: int
    ) -> dict[str, Any]:
        text = prompt.text + c.text if body.echo else c.text
        return _choice(index, text, self._logprobs(body, out, c, prompt), c)

    def _logprobs(
        self, body: CompletionRequest, out: RequestOutput | None, c: CompletionOutput, prompt: _Prompt | None
    ) -> dict[str, Any] | None:
        if body.logprobs is None or c.logprobs is None:
            return None
        generated = completion_logprobs(c.token_ids, list(c.logprobs), body.logprobs, 0, c.text_offsets)
        if not body.echo or out is None or prompt is None or out.prompt_logprobs is None:
            return generated
        text = self.service.tokenizer.token_text
        echoed = completion_logprobs(
            out.prompt_token_ids, out.prompt_logprobs, body.logprobs, 0, token_text=text
        )
        shift = len(prompt.text)
        generated["text_offset"] = [o + shift for o in generated["text_offset"]]
        return {key: echoed[key] + generated[key] for key in generated}

    async def stream(
        self, body: CompletionRequest, handles: list[RequestHandle], request_id: str
    ) -> AsyncIterator[str]:
        """Server-sent events: chunks as text arrives (choice index = prompt * n + sample), a usage
        chunk when asked, then [DONE]."""
        chunks = ChunkWriter({"id": request_id, "object": "text_completion", "created": now()}, self.service)
        counts: dict[int, int] = {}
        prompt_tokens = 0
        trackers = [self.service.tracker() for _ in handles]
        outputs = merge(h.outputs() for h in handles) if len(handles) > 1 else _tagged(handles[0])
        async for i, out in outputs:
            if any(c.token_ids for c in out.outputs):
                trackers[i].tokens_arrived()
            for c in out.outputs:
                if c.error is not None:
                    raise GenerationFailed(c.error)
                index = i * body.n + c.index
                first = index not in counts
                if first and c.index == 0:
                    prompt_tokens += len(out.prompt_token_ids)
                counts[index] = counts.get(index, 0) + len(c.token_ids)
                if first and body.echo:
                    yield chunks.choice(self._echoed_choice(body, out, c, index))
                elif c.text or c.token_ids or c.finish_reason is not None:
                    logprobs = self._logprobs(body, None, c, None)
                    yield chunks.choice(_choice(index, c.text, logprobs, c))
        completion_tokens = sum(counts.values())
        self.service.count(prompt_tokens, completion_tokens)
        if body.stream_options is not None and body.stream_options.include_usage:
            yield chunks.usage(prompt_tokens, completion_tokens)
        yield sse("[DONE]")

    def _echoed_choice(
        self, body: CompletionRequest, out: RequestOutput, c: CompletionOutput, index: int
    ) -> dict[str, Any]:
        prompt = self._prompt(out)
        return _choice(index, prompt.text + c.text, self._logprobs(body, out, c, prompt), c)


def _choice(index: int, text: str, logprobs: dict[str, Any] | None, c: CompletionOutput) -> dict[str, Any]:
    choice = {
        "index": index,
        "text": text,
        "logprobs": logprobs,
        "finish_reason": finish_reason(c),
        "stop_reason": c.stop_reason,
    }
    if c.log_weight is not None:
        choice["log_weight"] = finite(c.log_weight)
    return choice


async def _tagged(handle: RequestHandle) -> AsyncIterator[tuple[int, RequestOutput]]:
    async for output in handle.outputs():
        yield 0, output
