"""The offline Python API, named as vLLM users know it: `LLM(...).generate(prompts, params)`."""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm

from weft.agents.chat_tools import ChatTools
from weft.agents.reply import ReplyPlan
from weft.engine.args import EngineArgs
from weft.engine.beam import beam_score
from weft.engine.default_model import bundled_model_path, default_model_path
from weft.engine.factory import build_engine
from weft.kv_format import kv_dtype_name
from weft.model.prefill_gemm import NEVER
from weft.outputs import BeamSearchOutput, BeamSearchSequence, ChoiceScore, RequestOutput
from weft.params import BeamSearchParams, OutputKind, SamplingParams
from weft.tokenizer import Message, Tokenizer

# a prompt: its text, its token ids, or vLLM's TextPrompt / TokensPrompt ({"prompt": text} or
# {"prompt_token_ids": ids})
PromptInput = str | Sequence[int] | Mapping[str, Any]
PlainPrompt = str | Sequence[int]

__all__ = ["LLM", "OutputRouter", "bundled_model_path", "default_model_path"]


class OutputRouter:
    """Delivers every output of an engine step to its request's queue, whoever stepped the engine,
    so that `generate()`, `stream()` and other consumers of one engine never lose each other's
    outputs. Outputs of requests nobody registered are dropped."""

    def __init__(self) -> None:
        self._queues: dict[str, deque[RequestOutput]] = {}

    def register(self, request_id: str) -> None:
        self._queues[request_id] = deque()

    def unregister(self, request_id: str) -> None:
        self._queues.pop(request_id, None)

    def route(self, outputs: list[RequestOutput]) -> None:
        for output in outputs:
            queue = self._queues.get(output.request_id)
            if queue is not None:
                queue.append(output)

    def take(self, request_id: str) -> list[RequestOutput]:
        """Everything queued for `request_id`, oldest first."""
        queue = self._queues.get(request_id)
        if not queue:
            return []
        items = list(queue)
        queue.clear()
        return items


class LLM:
    """Load a checkpoint and generate from it.

    >>> llm = LLM()                      # the default model (SmolLM2-135M-Instruct where installed)
    >>> out = llm.generate("The capital of France is", SamplingParams(max_tokens=20, temperature=0))
    >>> out[0].outputs[0].text
    """

    def __init__(self, model: str | Path | None = None, **options: Any) -> None:
        """`model`: a checkpoint directory, a GGUF file or a Hugging Face model id (None: the
        default model, `default_model_path()`). `options`: the fields of `EngineArgs`
        (weft/engine/args.py), e.g. `dtype`, `device`, `max_model_len`, `max_num_seqs`,
        `kv_cache_memory_gb`, `matmul_precision`."""
        args = EngineArgs.of(model, options)
        self.engine = build_engine(args)
        self.show_progress = args.show_progress  # progress bars: loading, and generate's by default
        self.tokenizer = self.engine.tokenizer
        self.config = self.engine.config
        self.router = OutputRouter()
        self._ids = itertools.count()

    @property
    def kernels(self) -> dict[str, str]:
        """What runs the model, chosen once at load: the kernel set, the weights' and the
        activations' dtypes, what the matrix products multiply in, the linear-layer kernel and (on
        CPU) the ISA path, the instruction sets of the kernels' build, the KV cache's dtype and
        bytes a token (`kv_cache`) and whether the weights are in 2 MB pages (`pages`,
        weft/model/huge_pages.py)."""
        config = self.engine.config
        weights = config.weight_dtype or config.dtype
        info = self.engine.model.kernels.describe(config.device, weights, config.matmul_dtype)
        quantized = self.engine.model.quantized_matrices()
        if quantized:
            kinds = ", ".join(f"{kind.upper()} for {count} matrices" for kind, count in quantized.items())
            if self.engine.model.keeps_blocks:  # the kernel set multiplies the file's blocks (Triton)
                panels = "GGUF blocks, dequantized in the kernel"
            else:
                panels = "int8 dot panels" if config.matmul_dtype == torch.int8 else "exact quantized panels"
            info["linear"] += f"; {kinds} ({panels})"
        kv_bytes = self.engine.kv_bytes_per_token
        info["kv_cache"] = f"{kv_dtype_name(self.engine.runner.kv_dtype)} ({kv_bytes:,} bytes a token)"
        if self.engine.model.huge_page_bytes:
            info["pages"] = f"weights in 2 MB pages ({self.engine.model.huge_page_bytes / 1e6:.0f} MB)"
        thresholds = sorted(set(self.engine.model.dense_rows.values()))
        if thresholds:
            rows = [str(t) if t < NEVER else "never" for t in thresholds]
            info["prefill_gemm"] = f"torch GEMM from {'/'.join(rows)} rows"
        return info

    def get_tokenizer(self) -> Tokenizer:
        return self.tokenizer

    def generate(
        self,
        prompts: PromptInput | Sequence[PromptInput],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        use_tqdm: bool | None = None,
    ) -> list[RequestOutput]:
        """Generate for every prompt (a string, a list of token ids, or vLLM's {"prompt": ...} /
        {"prompt_token_ids": ...} dicts) and return the outputs in prompt order. Requests run
        batched; a list of params gives each prompt its own.
        `use_tqdm`: a progress bar over the prompts (default: as `LLM(show_progress=...)`)."""
        prompt_list = _as_prompt_list(prompts)
        param_list = _as_param_list(params, len(prompt_list))
        request_ids = self._add_all(
            prompt_list, [p.replace(output_kind=OutputKind.FINAL_ONLY) for p in param_list]
        )
        return self._run_to_completion(request_ids, self._bar(use_tqdm, len(prompt_list)))

    def chat(
        self,
        messages: list[Message] | list[list[Message]],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        add_generation_prompt: bool = True,
        chat_template: str | None = None,
        use_tqdm: bool | None = None,
        tools: Sequence[dict[str, Any]] | None = None,
        tool_choice: str | dict[str, Any] = "auto",
        parallel_tool_calls: bool = True,
        chat_template_kwargs: dict[str, Any] | None = None,
        tool_call_parser: str | None = None,
    ) -> list[RequestOutput]:
        """Generate replies to one conversation or a list of them, with the checkpoint's chat
        template; each output's `prompt` is the rendered conversation.

        `tools` (OpenAI's function tools) are given to the template; under `tool_choice="auto"`
        the model may call them in its family's format (detected from the template, or
        `tool_call_parser`), constrained once it starts a call; "required" or
        `{"type": "function", "function": {"name": ...}}` makes the reply one call; "none" hides
        them. Where tools are given or the template has a reasoning section, each completion's
        `message` holds the reply read as an assistant message (`content`, `reasoning_content`,
        `tool_calls`)."""
        conversations: list[list[Message]] = (
            [messages] if messages and isinstance(messages[0], dict) else messages  # type: ignore[assignment]
        )
        extra = dict(chat_template_kwargs or {})
        if tools and tool_choice != "none":
            extra["tools"] = list(tools)
        texts = [
            self.render_chat_text(c, add_generation_prompt, chat_template, **extra) for c in conversations
        ]
        # The template writes the special tokens (BOS included) itself.
        prompts = [self.tokenizer.encode(text, add_special_tokens=False) for text in texts]
        offered = tools if tool_choice != "none" else None
        chat_tools = ChatTools.of(self.tokenizer, chat_template, offered, tool_choice, tool_call_parser)
        param_list = _as_param_list(params, len(prompts))
        pairs = zip(texts, param_list, strict=True)
        plans = [chat_tools.plan(text, parallel_tool_calls, _json_answer(p)) for text, p in pairs]
        if chat_tools.active:  # the reply is read by markers that may be special tokens: keep them
            param_list = [_with_plan(p, plan) for p, plan in zip(param_list, plans, strict=True)]
        outputs = self.generate(prompts, param_list, use_tqdm=use_tqdm)
        for output, text, plan in zip(outputs, texts, plans, strict=True):
            output.prompt = text
            for c in output.outputs if chat_tools.active else ():
                c.message = plan.message(c.text, finished=c.finish_reason == "stop")
        return outputs

    def render_chat(
        self, messages: list[Message], add_generation_prompt: bool = True, chat_template: str | None = None
    ) -> list[int]:
        """The conversation's prompt token ids."""
        text = self.render_chat_text(messages, add_generation_prompt, chat_template)
        return self.tokenizer.encode(text, add_special_tokens=False)

    def render_chat_text(
        self,
        messages: list[Message],
        add_generation_prompt: bool = True,
        chat_template: str | None = None,
        **extra: Any,
    ) -> str:
        """The conversation rendered by the chat template (the checkpoint's, or `chat_template`);
        `extra`: more variables for the template (`tools`, `enable_thinking`, ...)."""
        from weft.tokenizer import render_chat_template

        if chat_template is None:
            return self.tokenizer.apply_chat_template(messages, add_generation_prompt, **extra)
        return render_chat_template(
            chat_template,
            messages,
            add_generation_prompt,
            bos_token=self.tokenizer.bos_token or "",
            eos_token=self.tokenizer.eos_token or "",
            **extra,
        )

    def stream(self, prompt: PromptInput, params: SamplingParams | None = None) -> Iterator[RequestOutput]:
        """Yield `RequestOutput`s carrying only what is new (text and tokens) as they are produced.
        Other calls on this `LLM` may run between two deltas; no delta is lost."""
        params = (params or SamplingParams()).replace(output_kind=OutputKind.DELTA)
        (request_id,) = self._add_all([_plain_prompt(prompt)], [params])
        try:
            while True:
                outputs = self.router.take(request_id)
                if not outputs:
                    self._step()
                for output in outputs:
                    yield output
                    if output.finished:
                        return
        finally:
            self.engine.abort_request(request_id)
            self.router.unregister(request_id)

    def beam_search(
        self,
        prompts: PromptInput | Sequence[PromptInput],
        params: BeamSearchParams,
        *,
        use_tqdm: bool | None = None,
    ) -> list[BeamSearchOutput]:
        """Beam search for every prompt, all batched together (and with any other request): one
        `BeamSearchOutput` per prompt, its finished beams sorted by score, best first."""
        prompt_list = _as_prompt_list(prompts)
        request_ids = self._add_all(prompt_list, [params] * len(prompt_list))
        outputs = self._run_to_completion(request_ids, self._bar(use_tqdm, len(prompt_list)))
        return [_beam_output(out, params.length_penalty) for out in outputs]

    def score(self, prompt: PromptInput, options: Sequence[str]) -> list[ChoiceScore]:
        """The total logprob of each option after `prompt` (and each token's), computed exactly in
        one batched pass that runs the prompt and every prefix the options share once."""
        return self.engine.score(_plain_prompt(prompt), options)  # type: ignore[arg-type]

    def _bar(self, use_tqdm: bool | None, num_prompts: int) -> bool:
        """Whether a call shows a progress bar: asked (default: `show_progress`), over several prompts."""
        return (self.show_progress if use_tqdm is None else use_tqdm) and num_prompts > 1

    def stats(self) -> dict[str, float]:
        return self.engine.stats().as_dict()

    def _add_all(
        self, prompts: list[PlainPrompt], params: Sequence[SamplingParams | BeamSearchParams]
    ) -> list[str]:
        added: list[str] = []
        try:
            for prompt, p in zip(prompts, params, strict=True):
                request_id = str(next(self._ids))
                self.engine.add_request(request_id, prompt, p)
                self.router.register(request_id)
                added.append(request_id)
        except Exception:
            for request_id in added:
                self.engine.abort_request(request_id)
                self.router.unregister(request_id)
            raise
        return added

    def _step(self) -> None:
        """One engine step; its outputs go to their requests' queues."""
        if not self.engine.has_unfinished_requests():
            raise RuntimeError("the engine has no work left but some requests never finished")
        self.router.route(self.engine.step())

    def _run_to_completion(self, request_ids: list[str], show_progress: bool) -> list[RequestOutput]:
        results: dict[str, RequestOutput] = {}
        with tqdm(total=len(request_ids), desc="Generating", unit="req", disable=not show_progress) as bar:
            try:
                while len(results) < len(request_ids):
                    self._step()
                    for request_id in request_ids:
                        for output in self.router.take(request_id):
                            if output.finished:
                                results[request_id] = output
                                bar.update(1)
            finally:
                for request_id in request_ids:
                    if request_id not in results:
                        self.engine.abort_request(request_id)
                    self.router.unregister(request_id)
        return [results[r] for r in request_ids]


def _beam_output(out: RequestOutput, length_penalty: float) -> BeamSearchOutput:
    errors = [c.error for c in out.outputs if c.error is not None]
    if errors:
        return BeamSearchOutput([], errors[0])
    sequences = [
        BeamSearchSequence(
            token_ids=c.token_ids,
            text=c.text,
            cumulative_logprob=c.cumulative_logprob or 0.0,
            score=beam_score(c.cumulative_logprob or 0.0, len(c.token_ids), length_penalty),
            finish_reason=c.finish_reason,
            stop_reason=c.stop_reason,
        )
        for c in out.outputs
    ]
    return BeamSearchOutput(sequences)


def _as_prompt_list(prompts: PromptInput | Sequence[PromptInput]) -> list[PlainPrompt]:
    if isinstance(prompts, (str, Mapping)):
        return [_plain_prompt(prompts)]
    items = list(prompts)
    if items and all(isinstance(t, int) for t in items):
        return [items]  # type: ignore[list-item]  # one prompt of token ids
    return [_plain_prompt(item) for item in items]  # type: ignore[arg-type]


PROMPT_KEYS = ("prompt", "prompt_token_ids")


def _plain_prompt(prompt: PromptInput) -> PlainPrompt:
    """A prompt's text or token ids; vLLM's TextPrompt and TokensPrompt dicts give theirs (the
    token ids where both are given). Any other key is refused: weft runs text-only models."""
    if not isinstance(prompt, Mapping):
        return prompt
    unknown = sorted(set(prompt) - set(PROMPT_KEYS))
    if unknown or not any(key in prompt for key in PROMPT_KEYS):
        raise ValueError(
            f"a prompt dict holds 'prompt' (text) or 'prompt_token_ids' (a list of ints); got keys "
            f"{sorted(prompt)}" + (" (weft runs text-only models)" if unknown else "")
        )
    if "prompt_token_ids" in prompt:
        ids = prompt["prompt_token_ids"]
        if isinstance(ids, str) or not isinstance(ids, Sequence) or not all(isinstance(t, int) for t in ids):
            raise ValueError("a prompt dict's 'prompt_token_ids' must be a list of ints")
        return ids
    if not isinstance(prompt["prompt"], str):
        raise ValueError("a prompt dict's 'prompt' must be a string")
    return prompt["prompt"]


def _json_answer(params: SamplingParams) -> dict[str, Any]:
    """A JSON constraint of `params`, which a chat reply's plan may hold after its reasoning."""
    if params.json_schema is not None:
        return {"json_schema": params.json_schema, "json_schema_mode": params.json_schema_mode}
    return {"json_object": True} if params.json_object else {}


def _with_plan(params: SamplingParams, plan: ReplyPlan) -> SamplingParams:
    if plan.constraint.get("grammar") is not None:  # the plan's grammar holds the JSON answer
        params = params.replace(json_schema=None, json_object=False)
    return params.replace(**plan.constraint, skip_special_tokens=False)


def _as_param_list(
    params: SamplingParams | Sequence[SamplingParams] | None, count: int
) -> list[SamplingParams]:
    if params is None:
        return [SamplingParams()] * count
    if isinstance(params, SamplingParams):
        return [params] * count
    param_list = list(params)
    if len(param_list) != count:
        raise ValueError(
            f"got {len(param_list)} SamplingParams for {count} prompts; give one, or one per prompt"
        )
    return param_list
