"""What the endpoints share: the engine loop, the model's name and tokenizer, validation done
before a request is queued, and the metrics."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

from weft.agents.chat_tools import AgentFormats
from weft.engine.engine import ContextOverflow
from weft.outputs import CompletionOutput, RequestOutput
from weft.params import SamplingParams
from weft.schema_objects import JsonSchemaMode
from weft.server.engine_loop import EngineLoop, RequestHandle
from weft.server.metrics import LatencyTracker, Metrics
from weft.server.protocol import RequestError
from weft.structured.grammar import GrammarError
from weft.tokenizer import Tokenizer

_LABELS = {
    "json_schema": "json_schema",
    "regex": "regex",
    "lark": "grammar",
    "gbnf": "grammar",
    "choice": "choice",
}


class UnknownModel(Exception):
    pass


class GenerationFailed(Exception):
    """A request's generation failed in the engine (the message says why)."""


async def only_completion(handle: RequestHandle) -> tuple[RequestOutput, CompletionOutput]:
    """The final output of a request of one completion, and that completion; GenerationFailed
    where it failed."""
    final: RequestOutput | None = None
    async for output in handle.outputs():
        final = output
    assert final is not None
    (completion,) = final.outputs
    if completion.error is not None:
        raise GenerationFailed(completion.error)
    return final, completion


class Service:
    def __init__(
        self,
        loop: EngineLoop,
        model_name: str,
        max_n: int = 128,
        json_schema_mode: JsonSchemaMode = JsonSchemaMode.CLOSED,
        formats: AgentFormats | None = None,
    ) -> None:
        self.loop = loop
        self.model_name = model_name
        self.max_n = max_n
        self.json_schema_mode = json_schema_mode  # for schemas whose request does not say strict
        self.formats = formats or AgentFormats()
        engine = loop.engine
        self.tokenizer: Tokenizer = engine.tokenizer
        self.vocab_size = engine.vocab_size
        self.max_model_len = engine.config.scheduler.max_model_len
        self.metrics = Metrics(lambda: loop.stats, model_name)
        loop.on_finish = self.metrics.request_finished
        engine.grammars  # noqa: B018  # build the grammar manager now, not on a request's path

    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.model_name:
            raise UnknownModel(f"the model {model!r} does not exist; this server serves {self.model_name!r}")

    async def validate_constraint(self, params: SamplingParams, field: str | None = None) -> None:
        """Compile the request's grammar now (cached, off the event loop): an invalid schema,
        regex or grammar is a 400 naming the request's `field`, not a request that fails later."""
        if params.structured is None or params.exact_choice:
            return
        grammars = self.loop.engine.grammars
        try:
            await asyncio.to_thread(grammars.validate, params.structured)
        except GrammarError as exc:  # "invalid lark: ..." -> "invalid grammar: ..."
            kind = params.structured.kind.value
            message = str(exc).removeprefix(f"invalid {kind}: ")
            raise RequestError(f"invalid {_LABELS.get(kind, kind)}: {message}", field) from None

    def check_limits(self, params: SamplingParams) -> None:
        if params.num_samples > self.max_n:
            raise RequestError(
                f"n={params.n}, best_of={params.best_of}: at most {self.max_n} sequences per request", "n"
            )
        if params.smc is not None and params.n * params.smc.num_particles > self.max_n:
            raise RequestError(
                f"n={params.n} runs of smc.num_particles={params.smc.num_particles}: at most "
                f"{self.max_n} sequences per request",
                "smc.num_particles",
            )

    async def add_all(
        self,
        request_id: str,
        prompts: Sequence[str | list[int]],
        params: SamplingParams,
        max_tokens_field: str = "max_tokens",
    ) -> list[RequestHandle]:
        """Queue one engine request per prompt, all or none. `max_tokens_field`: the request's
        name for max_tokens, which a prompt too long for it is reported under."""
        handles: list[RequestHandle] = []
        try:
            for i, prompt in enumerate(prompts):
                handles.append(await self.loop.add(f"{request_id}-{i}", prompt, params))
        except BaseException as exc:
            for handle in handles:
                handle.close()
            if isinstance(exc, ContextOverflow):
                raise RequestError(exc.describe(max_tokens_field), max_tokens_field) from None
            raise
        return handles

    def count(self, prompt_tokens: int, completion_tokens: int) -> None:
        self.metrics.count_tokens(prompt_tokens, completion_tokens)

    def tracker(self) -> LatencyTracker:
        return LatencyTracker(self.metrics)
