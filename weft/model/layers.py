"""Building blocks shared by the model families: linear layers, RMSNorm, rotary embeddings."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from weft.config import RopeConfig, RopeType
from weft.native import use_kernels


class Linear(nn.Module):
    """`y = x @ W.T + b`. The weight is loaded in the Hugging Face [out, in] layout; on CPU in
    float32 the loader then stores it input-major, as a contiguous [in, out] matrix used as
    `x @ W` (`use_input_major_layout`).

    Measured on the 2-core CPU machines (interleaved A/B over whole decode steps of a SmolLM2-135M
    shaped model, docs/benchmarks.md): in float32 `x @ W` on [in, out] is 1.2-1.4x faster than
    `F.linear` on [out, in] at every batch size, 1.6-1.8x on the output projection; in bfloat16 and
    float16 it is slower at batch 1 and equal at batch 8, so half precision keeps [out, in], and a
    single bfloat16 row goes through `torch.mv`.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = False) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False) if bias else None
        self.input_major = False  # True: weight is [in, out]

    def use_input_major_layout(self) -> None:
        """Store the weight as a contiguous [in, out] copy (a tied weight is no longer shared)."""
        if not self.input_major:
            self.weight = nn.Parameter(self.weight.t().contiguous(), requires_grad=False)
            self.input_major = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, in] -> [T, out]
        if self.input_major:
            return x @ self.weight if self.bias is None else torch.addmm(self.bias, x, self.weight)
        if x.shape[0] == 1 and x.dtype == torch.bfloat16 and x.device.type == "cpu":
            out = torch.mv(self.weight, x[0]).unsqueeze(0)
            return out if self.bias is None else out + self.bias
        return F.linear(x, self.weight, self.bias)


def prefers_input_major(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether `Linear` weights should be stored [in, out] for this device and dtype (see `Linear`)."""
    return device.type == "cpu" and dtype == torch.float32


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., dim]
        if x.dim() == 2 and x.stride(1) == 1 and use_kernels(x.device):
            return torch.ops.weft.rms_norm(x, self.weight, self.eps)
        if x.dtype == torch.float32:
            return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)
        # Half precision: normalise in float32 as the reference implementations do.
        normed = F.rms_norm(x.float(), (x.shape[-1],), None, self.eps)
        return self.weight * normed.to(x.dtype)


def rope_inv_freq(head_dim: int, rope: RopeConfig) -> torch.Tensor:  # [head_dim // 2] float32
    inv_freq = 1.0 / (rope.theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    if rope.rope_type == RopeType.LINEAR:
        inv_freq = inv_freq / rope.factor
    elif rope.rope_type == RopeType.LLAMA3:
        inv_freq = _llama3_scaled(inv_freq, rope)
    return inv_freq.float()


def _llama3_scaled(inv_freq: torch.Tensor, rope: RopeConfig) -> torch.Tensor:
    """Llama 3.1 frequency scaling: long wavelengths are divided by `factor`, short ones kept,
    and the band between is interpolated smoothly."""
    old_len = rope.original_max_position_embeddings
    low_wavelen = old_len / rope.low_freq_factor
    high_wavelen = old_len / rope.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    smooth = (old_len / wavelen - rope.low_freq_factor) / (rope.high_freq_factor - rope.low_freq_factor)
    interpolated = (1 - smooth) * inv_freq / rope.factor + smooth * inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / rope.factor, inv_freq)
    is_medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(is_medium, interpolated, scaled)


class RotaryEmbedding(nn.Module):
    """Rotary position embedding in the half-split ("rotate_half") layout used by Llama-family
    checkpoints on Hugging Face."""

    cos: torch.Tensor  # [max_positions, D/2] float32
    sin: torch.Tensor  # [max_positions, D/2] float32

    def __init__(
        self, head_dim: int, max_positions: int, rope: RopeConfig, device: torch.device | None = None
    ):
        super().__init__()
        inv_freq = rope_inv_freq(head_dim, rope)  # [D/2]
        angles = torch.outer(torch.arange(max_positions, dtype=torch.float32), inv_freq)  # [P, D/2]
        # plain attributes, not buffers: the tables stay float32 when the model moves to half precision
        self.cos = angles.cos().to(device)  # [P, D/2]
        self.sin = angles.sin().to(device)  # [P, D/2]

    def tables(self, positions: torch.Tensor, dtype: torch.dtype) -> RopeTables:
        """The rotation of one step's tokens at `positions` ([T] int64), shared by all layers."""
        if use_kernels(positions.device):
            return RopeTables(positions, self.cos, self.sin, native=True)
        cos = self.cos[positions].unsqueeze(1).to(dtype)  # [T, 1, D/2]
        sin = self.sin[positions].unsqueeze(1).to(dtype)  # [T, 1, D/2]
        return RopeTables(positions, cos, sin, native=False)


@dataclass(frozen=True, slots=True)
class RopeTables:
    positions: torch.Tensor  # [T] int64
    cos: (
        torch.Tensor
    )  # native: the whole table [P, D/2] float32; else the step's rows [T, 1, D/2] in x's dtype
    sin: torch.Tensor  # as cos
    native: bool


def apply_rope_(x: torch.Tensor, rope: RopeTables) -> None:
    """Rotate x in place. x: [T, heads, D] (a view into the fused q/k/v output)."""
    if rope.native:
        torch.ops.weft.rope_(x, rope.positions, rope.cos, rope.sin, x.shape[1])
        return
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    rotated1 = x1 * rope.cos - x2 * rope.sin
    x2.mul_(rope.cos).addcmul_(x1, rope.sin)
    x1.copy_(rotated1)
