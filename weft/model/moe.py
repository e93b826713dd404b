"""A mixture of experts in place of a layer's MLP (Qwen3-MoE, Mixtral, OLMoE).

The router scores every expert for each row (a small [E, hidden] matrix), takes the softmax over
the experts, keeps the `experts_per_token` most probable and, where the family says so
(`ModelConfig.norm_topk_prob`: Qwen3-MoE, Mixtral), divides their weights by their sum; Mixtral's
softmax over its top-k logits is the same thing. A step then groups its rows by expert: each
expert routed to multiplies its own gate|up and down matrices once, for all the rows routed to it,
so only the active experts' weights are read (batch 1 reads its `experts_per_token` experts and no
more), and their outputs, each scaled by its routing weight, are added into the rows they came from.
Each expert is an ordinary pair of `Linear` layers, so quantized experts run through the same
panels as dense matrices.
"""

from __future__ import annotations

import torch
from torch import nn

from weft.config import ModelConfig
from weft.kernels import TorchKernels
from weft.model.layers import BFloat16Pairs, Linear


class Expert(nn.Module):
    """One expert: SwiGLU over its own gate|up and down matrices."""

    def __init__(self, hidden_size: int, intermediate_size: int, kernels: TorchKernels) -> None:
        super().__init__()
        self.kernels = kernels
        self.gate_up = Linear(hidden_size, 2 * intermediate_size)
        self.down = Linear(intermediate_size, hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [N, hidden] -> [N, hidden]
        return self.down(self.kernels.silu_mul(self.gate_up(x)))


class SparseMoE(nn.Module):
    def __init__(self, config: ModelConfig, kernels: TorchKernels) -> None:
        super().__init__()
        self.top_k = config.experts_per_token
        self.normalize = config.norm_topk_prob
        self.router = Linear(config.hidden_size, config.num_experts)
        inter = config.moe_intermediate_size
        self.experts = nn.ModuleList(
            Expert(config.hidden_size, inter, kernels) for _ in range(config.num_experts)
        )

    def forward(self, x: torch.Tensor | BFloat16Pairs, rows: object = None) -> torch.Tensor:  # [T, hidden]
        assert isinstance(x, torch.Tensor)  # (its norm writes floats: `takes_pairs` is False)
        weights, chosen = self.route(x)  # [T, k] each
        out = torch.zeros_like(x)  # [T, hidden]
        flat = chosen.flatten()  # [T * k]: row t's choices at t * k ...
        order = torch.argsort(flat, stable=True)  # the choices grouped by expert
        counts = torch.bincount(flat, minlength=len(self.experts)).tolist()
        row_of = order // self.top_k  # [T * k] the row of each grouped choice
        scale = weights.flatten()[order]  # [T * k]
        start = 0
        for expert, count in zip(self.experts, counts, strict=True):
            if count:
                rows_e = row_of[start : start + count]  # [n]
                y = expert(x.index_select(0, rows_e))  # [n, hidden]
                out.index_add_(0, rows_e, y.mul_(scale[start : start + count, None].to(y.dtype)))
            start += count
        return out

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # [T, k] float32, [T, k] int64
        """Each row's experts and their weights."""
        probs = torch.softmax(self.router(x).float(), dim=-1)  # [T, E]
        weights, chosen = torch.topk(probs, self.top_k, dim=-1)
        if self.normalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights, chosen

    def takes_pairs(self, num_tokens: int) -> bool:
        return False
