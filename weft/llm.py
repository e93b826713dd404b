"""The offline Python API, named as vLLM users know it: `LLM(...).generate(prompts, params)`."""

from __future__ import annotations

import itertools
import os
from collections.abc import Iterator, Sequence
from pathlib import Path

import torch
from tqdm.auto import tqdm

from weft.config import (
    CacheConfig,
    ConfigError,
    EngineConfig,
    ModelConfig,
    SchedulerConfig,
    read_optional_json,
    resolve_device,
    resolve_dtype,
)
from weft.engine.engine import LLMEngine
from weft.engine.runner import ModelRunner
from weft.model.loader import load_config, load_model
from weft.outputs import RequestOutput
from weft.params import OutputKind, SamplingParams
from weft.tokenizer import Message, Tokenizer

PromptInput = str | Sequence[int]
DEFAULT_MAX_MODEL_LEN = 8192
CHECKPOINT_PATTERNS = ["*.json", "*.safetensors", "tokenizer.model", "*.jinja"]


def default_model_path() -> Path:
    """The directory of the small model bundled with weft (trained on Tiny Shakespeare)."""
    return Path(__file__).resolve().parent / "default_model"


def resolve_model_path(model: str | Path | None) -> Path:
    """A local checkpoint directory for `model`: None means the bundled model; a path is used as
    it is; anything else is a Hugging Face model id, downloaded when online."""
    if model is None:
        return default_model_path()
    path = Path(model).expanduser()
    if path.is_dir():
        return path
    if path.exists() or str(model).startswith((".", "/", "~")):
        raise ConfigError(f"{path}: not a checkpoint directory")
    return _download(str(model))


def _download(model_id: str) -> Path:
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HFValidationError

    try:
        return Path(snapshot_download(model_id, allow_patterns=CHECKPOINT_PATTERNS))
    except HFValidationError:
        raise ConfigError(f"{model_id!r} is neither a local directory nor a valid model id") from None
    except Exception as exc:
        offline = os.environ.get("HF_HUB_OFFLINE") == "1"
        hint = "offline (HF_HUB_OFFLINE=1)" if offline else "unreachable or unknown"
        raise ConfigError(
            f"{model_id!r} is not a local directory, and the Hugging Face hub is {hint} "
            f"({type(exc).__name__}); "
            "pass the path of a downloaded checkpoint directory instead"
        ) from None


class LLM:
    """Load a checkpoint and generate from it.

    >>> llm = LLM()                      # the bundled model
    >>> out = llm.generate("ROMEO:", SamplingParams(max_tokens=20, temperature=0))
    >>> out[0].outputs[0].text
    """

    def __init__(
        self,
        model: str | Path | None = None,
        *,
        dtype: str | torch.dtype | None = None,
        device: str | torch.device | None = None,
        max_model_len: int | None = None,
        block_size: int = 16,
        max_num_seqs: int = 64,
        max_num_batched_tokens: int | None = None,
        num_kv_blocks: int | None = None,
        kv_cache_memory_gb: float | None = None,
        enable_prefix_caching: bool = True,
        seed: int = 0,
        show_progress: bool = True,
    ) -> None:
        self.model_path = resolve_model_path(model)
        torch_device = resolve_device(device)
        torch_dtype = resolve_dtype(dtype, torch_device)
        model_config = load_config(self.model_path)
        model_config = _with_generation_eos(model_config, self.model_path)
        self.tokenizer = Tokenizer.from_dir(self.model_path)
        max_len = min(max_model_len or DEFAULT_MAX_MODEL_LEN, model_config.max_position_embeddings)
        if max_model_len is not None and max_model_len > model_config.max_position_embeddings:
            raise ConfigError(
                f"max_model_len={max_model_len} exceeds the model's max_position_embeddings "
                f"({model_config.max_position_embeddings})"
            )
        cache = CacheConfig(
            block_size=block_size,
            num_blocks=num_kv_blocks
            or _default_num_blocks(
                model_config, block_size, torch_dtype, torch_device, max_len, max_num_seqs, kv_cache_memory_gb
            ),
            enable_prefix_caching=enable_prefix_caching,
        )
        if cache.num_blocks * block_size < max_len:
            raise ConfigError(
                f"{cache.num_blocks} KV blocks of {block_size} tokens cannot hold one sequence of "
                f"max_model_len={max_len}; give more blocks or a smaller max_model_len"
            )
        scheduler = SchedulerConfig(max_num_seqs, max_num_batched_tokens or max(2048, block_size), max_len)
        self.config = EngineConfig(model_config, cache, scheduler, torch_device, torch_dtype, seed)
        model_module = load_model(
            self.model_path, model_config, torch_dtype, torch_device, max_len, show_progress
        )
        self.engine = LLMEngine(self.config, model_module, self.tokenizer)
        self._ids = itertools.count()

    def get_tokenizer(self) -> Tokenizer:
        return self.tokenizer

    def generate(
        self,
        prompts: PromptInput | Sequence[PromptInput],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Generate for every prompt (a string or a list of token ids) and return the outputs in
        prompt order. Requests run batched; a list of params gives each prompt its own."""
        prompt_list = _as_prompt_list(prompts)
        param_list = _as_param_list(params, len(prompt_list))
        request_ids = self._add_all(
            prompt_list, [p.replace(output_kind=OutputKind.FINAL_ONLY) for p in param_list]
        )
        return self._run_to_completion(request_ids, use_tqdm and len(prompt_list) > 1)

    def chat(
        self,
        messages: list[Message] | list[list[Message]],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        add_generation_prompt: bool = True,
        chat_template: str | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Generate replies to one conversation or a list of them, with the checkpoint's chat template."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = [self.render_chat(c, add_generation_prompt, chat_template) for c in conversations]  # type: ignore[arg-type]
        return self.generate(prompts, params, use_tqdm=use_tqdm)

    def render_chat(
        self, messages: list[Message], add_generation_prompt: bool = True, chat_template: str | None = None
    ) -> list[int]:
        from weft.tokenizer import render_chat_template

        if chat_template is None:
            text = self.tokenizer.apply_chat_template(messages, add_generation_prompt)
        else:
            text = render_chat_template(
                chat_template,
                messages,
                add_generation_prompt,
                bos_token=self.tokenizer.bos_token or "",
                eos_token=self.tokenizer.eos_token or "",
            )
        # The template writes the special tokens (BOS included) itself.
        return self.tokenizer.encode(text, add_special_tokens=False)

    def stream(self, prompt: PromptInput, params: SamplingParams | None = None) -> Iterator[RequestOutput]:
        """Yield `RequestOutput`s carrying only what is new (text and tokens) as they are produced."""
        params = (params or SamplingParams()).replace(output_kind=OutputKind.DELTA)
        (request_id,) = self._add_all([prompt], [params])
        try:
            finished = False
            while not finished:
                for output in self.engine.step():
                    if output.request_id == request_id:
                        finished = output.finished
                        yield output
        finally:
            self.engine.abort_request(request_id)

    def stats(self) -> dict[str, float]:
        return self.engine.stats().as_dict()

    def _add_all(self, prompts: list[PromptInput], params: list[SamplingParams]) -> list[str]:
        added: list[str] = []
        try:
            for prompt, p in zip(prompts, params, strict=True):
                request_id = str(next(self._ids))
                self.engine.add_request(request_id, prompt, p)
                added.append(request_id)
        except Exception:
            for request_id in added:
                self.engine.abort_request(request_id)
            raise
        return added

    def _run_to_completion(self, request_ids: list[str], show_progress: bool) -> list[RequestOutput]:
        wanted = set(request_ids)
        results: dict[str, RequestOutput] = {}
        with tqdm(total=len(request_ids), desc="Generating", unit="req", disable=not show_progress) as bar:
            try:
                while len(results) < len(request_ids):
                    if not self.engine.has_unfinished_requests():
                        raise RuntimeError("the engine has no work left but some requests never finished")
                    for output in self.engine.step():
                        if output.finished and output.request_id in wanted:
                            results[output.request_id] = output
                            bar.update(1)
            except BaseException:
                for request_id in wanted - results.keys():
                    self.engine.abort_request(request_id)
                raise
        return [results[r] for r in request_ids]


def _as_prompt_list(prompts: PromptInput | Sequence[PromptInput]) -> list[PromptInput]:
    if isinstance(prompts, str):
        return [prompts]
    items = list(prompts)
    if items and all(isinstance(t, int) for t in items):
        return [items]  # type: ignore[list-item]  # one prompt of token ids
    return items  # type: ignore[return-value]


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


def _with_generation_eos(config: ModelConfig, model_dir: Path) -> ModelConfig:
    """generation_config.json may name more end-of-sequence tokens than config.json."""
    from dataclasses import replace

    gen = read_optional_json(model_dir / "generation_config.json")
    eos = gen.get("eos_token_id")
    extra = tuple(eos) if isinstance(eos, list) else ((eos,) if isinstance(eos, int) else ())
    merged = tuple(dict.fromkeys(config.eos_token_ids + extra))
    return replace(config, eos_token_ids=merged)


def _default_num_blocks(
    config: ModelConfig,
    block_size: int,
    dtype: torch.dtype,
    device: torch.device,
    max_len: int,
    max_num_seqs: int,
    memory_gb: float | None,
) -> int:
    """As many blocks as `memory_gb` holds (default: 2 GiB on CPU, half the free memory on CUDA),
    but no more than every sequence at full length needs, and at least one full-length sequence."""
    per_block = ModelRunner.kv_bytes_per_block(config, block_size, dtype)
    if memory_gb is None:
        budget = torch.cuda.mem_get_info(device)[0] // 2 if device.type == "cuda" else 2 * 1024**3
    else:
        budget = int(memory_gb * 1024**3)
    blocks_per_seq = -(-max_len // block_size)
    return max(blocks_per_seq + 1, min(budget // per_block, blocks_per_seq * max_num_seqs))
