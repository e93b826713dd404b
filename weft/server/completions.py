"""POST /v1/completions: one engine request per prompt, streamed or collected."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from weft.outputs import CompletionOutput, RequestOutput
from weft.params import OutputKind
from weft.server.engine_loop import RequestHandle, merge, now
from weft.server.protocol import CompletionRequest
from weft.server.responses import completion_logprobs, finish_reason, sse, usage
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
        params = body.sampling_params(service.vocab_size)
        kind = OutputKind.DELTA if body.stream else OutputKind.FINAL_ONLY
        if body.stream and params.num_samples > params.n:
            raise ValueError("best_of > n cannot be streamed (the best are known only at the end)")
        params = params.replace(output_kind=kind)
        service.check_limits(params)
        await service.validate_constraint(params)
        request_id = f"cmpl-{uuid.uuid4().hex}"
        handles = await service.add_all(request_id, body.prompts(), params)
        return body, handles, request_id

    async def respond(self, body: CompletionRequest, handles: list[RequestHandle], request_id: str) -> dict:
        finals: list[RequestOutput] = []
        async for _, output in merge(h.outputs() for h in handles):
            if output.finished:
                finals.append(output)
        finals.sort(key=lambda o: int(o.request_id.rsplit("-", 1)[1]))
        choices = []
        for i, out in enumerate(finals):
            prompt = self._prompt(out)
            for c in out.outputs:
                if c.error is not None:
                    raise GenerationFailed(c.error)
                choices.append(self._choice(body, out, c, prompt, i * body.n + c.index))
        prompt_tokens = sum(len(o.prompt_token_ids) for o in finals)
        completion_tokens = sum(len(c.token_ids) for o in finals for c in o.outputs)
        self.service.count(prompt_tokens, completion_tokens)
        return {
            "id": request_id,
            "object": "text_completion",
            "created": now(),
            "model": self.service.model_name,
            "choices": choices,
            "usage": usage(prompt_tokens, completion_tokens),
        }

    def _prompt(self, out: RequestOutput) -> _Prompt:
        text = out.prompt if out.prompt is not None else self.service.tokenizer.decode(out.prompt_token_ids)
        return _Prompt(text, len(out.prompt_token_ids))

    def _choice(
        self, body: CompletionRequest, out: RequestOutput, c: CompletionOutput, prompt: _Prompt, index: int
    ) -> dict[str, Any]:
        text = prompt.text + c.text if body.echo else c.text
        return {
            "index": index,
            "text": text,
            "logprobs": self._logprobs(body, out, c, prompt),
            "finish_reason": finish_reason(c),
            "stop_reason": c.stop_reason,
        }

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
        created, model = now(), self.service.model_name
        counts: dict[int, int] = {}
        prompt_tokens = 0
        echoed: set[int] = set()
        trackers = [self.service.tracker() for _ in handles]
        async for i, out in merge(h.outputs() for h in handles):
            if i not in echoed:
                echoed.add(i)
                prompt_tokens += len(out.prompt_token_ids)
            prompt = self._prompt(out)
            if any(c.token_ids for c in out.outputs):
                trackers[i].tokens_arrived()
            for c in out.outputs:
                if c.error is not None:
                    raise GenerationFailed(c.error)
                index = i * body.n + c.index
                first = index not in counts
                counts[index] = counts.get(index, 0) + len(c.token_ids)
                if not c.text and not c.token_ids and c.finish_reason is None and not (first and body.echo):
                    continue
                text = (prompt.text if first and body.echo else "") + c.text
                choice = {
                    "index": index,
                    "text": text,
                    "logprobs": self._logprobs(body, out if first else None, c, prompt if first else None),
                    "finish_reason": finish_reason(c),
                    "stop_reason": c.stop_reason,
                }
                chunk = {"id": request_id, "object": "text_completion", "created": created, "model": model}
                yield sse({**chunk, "choices": [choice]})
        completion_tokens = sum(counts.values())
        self.service.count(prompt_tokens, completion_tokens)
        if body.stream_options is not None and body.stream_options.include_usage:
            chunk = {"id": request_id, "object": "text_completion", "created": created, "model": model}
            yield sse({**chunk, "choices": [], "usage": usage(prompt_tokens, completion_tokens)})
        yield sse("[DONE]")
