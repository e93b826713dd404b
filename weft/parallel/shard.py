"""Which part of the model one tensor-parallel rank holds.

Column-parallel (split by output rows): q, k and v by heads (k and v by KV heads, so that each
rank attends with whole KV heads and holds its own shard of every KV-cache block), gate and up by
MLP columns. Row-parallel (split by input columns, one all-reduce of the output): the attention's
output projection and the MLP's down projection; a bias of theirs is added once, on rank 0.
Vocabulary-parallel: the embedding table and the lm_head by vocabulary rows (the embedding's
rows outside a rank's range read as zeros, summed by one all-reduce; the logits of each range are
gathered on rank 0). The norms are replicated. A rank's model is the same `LlamaForCausalLM` built
from the shard's configuration (`Shard.config`: heads, KV heads, MLP width and vocabulary divided
by the number of ranks); the checkpoint's tensors are cut as they are read (`Shard.tensor`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace

import torch

from weft.config import ConfigError, ModelConfig

_LAYER = re.compile(r"^model\.layers\.\d+\.(.+)$")
# Hugging Face tensor names (within a layer) -> how a rank cuts them
_COLUMNS = {  # output rows, by what
    "self_attn.q_proj.weight": "heads",
    "self_attn.q_proj.bias": "heads",
    "self_attn.k_proj.weight": "kv_heads",
    "self_attn.k_proj.bias": "kv_heads",
    "self_attn.v_proj.weight": "kv_heads",
    "self_attn.v_proj.bias": "kv_heads",
    "mlp.gate_proj.weight": "mlp",
    "mlp.up_proj.weight": "mlp",
}
_ROWS = {"self_attn.o_proj.weight": "heads", "mlp.down_proj.weight": "mlp"}  # input columns
_ONCE = {"self_attn.o_proj.bias"}  # a row-parallel layer's bias: rank 0's alone
_VOCAB = {"model.embed_tokens.weight", "lm_head.weight"}


@dataclass(frozen=True, slots=True)
class Shard:
    rank: int
    world_size: int

    def check(self, config: ModelConfig) -> None:
        """A ConfigError naming what does not divide by the number of ranks."""
        n = self.world_size
        if config.architecture == "Olmo2ForCausalLM":  # its q/k norms span the heads of every rank
            raise ConfigError(
                "tensor parallelism does not run OLMo 2 (its q and k norms span all heads, which the "
                "ranks split); use tensor_parallel_size=1"
            )
        if config.num_experts:
            raise ConfigError(
                "tensor parallelism does not split a mixture of experts yet; use tensor_parallel_size=1"
            )
        sizes = {
            "num_attention_heads": config.num_heads,
            "num_key_value_heads": config.num_kv_heads,
            "intermediate_size": config.intermediate_size,
            "vocab_size": config.vocab_size,
        }
        for name, size in sizes.items():
            if size % n:
                raise ConfigError(
                    f"tensor_parallel_size={n} does not divide the model's {name} ({size}): each rank "
                    f"holds an equal share of it; use a tensor_parallel_size that divides {size}"
                )

    def config(self, config: ModelConfig) -> ModelConfig:
        """The configuration of this rank's part of the model (its heads, MLP columns, vocabulary)."""
        n = self.world_size
        return replace(
            config,
            num_heads=config.num_heads // n,
            num_kv_heads=config.num_kv_heads // n,
            intermediate_size=config.intermediate_size // n,
            vocab_size=config.vocab_size // n,
        )

    def vocab_start(self, config: ModelConfig) -> int:
        """The first vocabulary id of this rank's rows (of the full `config`)."""
        return self.rank * (config.vocab_size // self.world_size)

    def tensor(self, name: str, tensor: torch.Tensor, config: ModelConfig) -> torch.Tensor:
        """This rank's part of the checkpoint tensor `name` (of the full `config`), contiguous."""
        if name in _VOCAB:
            return self._part(tensor, 0, config.vocab_size)
        match = _LAYER.match(name)
        if match is None:
            return tensor  # the final norm
        local = match.group(1)
        if local in _COLUMNS:
            return self._part(tensor, 0, self._units(config, _COLUMNS[local]))
        if local in _ROWS:
            return self._part(tensor, 1, self._units(config, _ROWS[local]))
        if local in _ONCE:
            return tensor if self.rank == 0 else torch.zeros_like(tensor)
        return tensor  # norms

    def _units(self, config: ModelConfig, by: str) -> int:
        """How many units (heads, KV heads, MLP columns) of the dimension a cut divides."""
        return {"heads": config.num_heads, "kv_heads": config.num_kv_heads, "mlp": config.intermediate_size}[
            by
        ]

    def _part(self, tensor: torch.Tensor, dim: int, units: int) -> torch.Tensor:
        """The rank's equal share of `units` units along `dim` (each unit tensor.shape[dim] / units
        wide: a head is head_dim rows)."""
        width = tensor.shape[dim] // units * (units // self.world_size)
        return tensor.narrow(dim, self.rank * width, width).contiguous()
