"""The model runner: owns the KV tensors, turns a `SchedulerOutput` into model inputs, runs the
forward pass and returns the logits of the rows that sample this step."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from weft.config import CacheConfig, ModelConfig
from weft.engine.scheduler import SchedulerOutput
from weft.model.attention import AttentionMetadata, PagedAttention
from weft.model.llama import KVCache, LlamaForCausalLM


@dataclass(frozen=True, slots=True)
class ModelInput:
    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    attn: AttentionMetadata
    logits_indices: torch.Tensor  # [S] int64, the last token of each sampling sequence


class ModelRunner:
    def __init__(
        self,
        model: LlamaForCausalLM,
        model_config: ModelConfig,
        cache_config: CacheConfig,
        device: torch.device,
        dtype: torch.dtype,
    ) -> None:
        self.model = model
        self.device = device
        self.block_size = cache_config.block_size
        self.attention = model.attention  # the backend: the cache layout and the step's metadata
        shape = self.attention.kv_cache_shape(
            cache_config.num_blocks, cache_config.block_size, model_config.num_kv_heads, model_config.head_dim
        )
        # Zero-filled: slots never written are masked out, but 0 * garbage could still be NaN.
        self.kv_caches: list[KVCache] = [
            torch.zeros(shape, dtype=dtype, device=device) for _ in range(model_config.num_layers)
        ]

    @staticmethod
    def kv_bytes_per_block(model_config: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
        shape = PagedAttention.kv_cache_shape(1, block_size, model_config.num_kv_heads, model_config.head_dim)
        return math.prod(shape) * model_config.num_layers * torch.tensor([], dtype=dtype).element_size()

    def prepare(self, sched: SchedulerOutput) -> ModelInput:
        input_ids: list[int] = []
        query_lens: list[int] = []
        context_lens: list[int] = []
        logits_indices: list[int] = []
        for item in sched.scheduled:
            seq = item.seq
            start = seq.num_computed_tokens
            input_ids.extend(seq.token_ids[start : start + item.num_new_tokens])
            query_lens.append(item.num_new_tokens)
            context_lens.append(start + item.num_new_tokens)
            if item.samples:
                logits_indices.append(len(input_ids) - 1)
        attn, positions = self.attention.build_metadata(
            query_lens, context_lens, [s.block_ids for s in sched.scheduled], self.block_size, self.device
        )
        return ModelInput(
            input_ids=torch.from_numpy(np.array(input_ids, dtype=np.int64)).to(self.device),
            positions=positions,
            attn=attn,
            logits_indices=torch.from_numpy(np.array(logits_indices, dtype=np.int64)).to(self.device),
        )

    @torch.inference_mode()
    def execute(self, sched: SchedulerOutput) -> torch.Tensor:
        """Run one step; returns logits [S, V] float32 for the sampling sequences, in order."""
        self.copy_blocks(sched.block_copies)
        inputs = self.prepare(sched)
        hidden = self.model(inputs.input_ids, inputs.positions, self.kv_caches, inputs.attn)  # [T, hidden]
        return self.model.compute_logits(hidden[inputs.logits_indices])

    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        """Copy-on-write: duplicate shared blocks before a sequence writes into its private copy."""
        if not copies:
            return
        src = torch.tensor([s for s, _ in copies], device=self.device)
        dst = torch.tensor([d for _, d in copies], device=self.device)
        for kv_cache in self.kv_caches:
            kv_cache[dst] = kv_cache[src]
