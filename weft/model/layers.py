"""Building blocks shared by the model families: linear layers, RMSNorm, rotary embeddings."""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from weft.config import ConfigError, RopeConfig, RopeType
from weft.kernels import TORCH_KERNELS, BlockPart, PanelPart, RopeTables, TorchKernels


@dataclass(frozen=True, slots=True)
class BFloat16Pairs:
    """Activations [T, K] already rounded to bfloat16, in the tile layout that bfloat16 products
    read (`bf16_dot`; weft/native/linear.cpp): what a norm hands the q|k|v or fused gate|up projection
    after it (`RMSNorm.pairs_`), so that neither its float32 [T, K] nor a second pass to round it
    reaches memory."""

    words: torch.Tensor  # [tiles, K / 2, rows] int32: pair kk of a tile's row i at [kk, i]
    num_rows: int  # T


def num_rows(x: torch.Tensor | BFloat16Pairs) -> int:
    return x.num_rows if isinstance(x, BFloat16Pairs) else x.shape[0]


@dataclass(frozen=True, slots=True)
class StepRows:
    """Which rows of a step may multiply through the BLAS GEMM (`Linear.dense_rows`). The panel
    kernel computes a row the same whatever else is in the step; the GEMM's rounding is its own. So
    a row of a generated token (decode, forced, drafted, recomputed after preemption) always takes
    the panels, and speculation, fast-forward and the batch around a sequence never change its
    numbers; a step's prompt rows take the GEMM when a matrix's threshold counts at least that many
    of them (long prefills, where it is faster)."""

    num_prompt: int  # rows of prompt tokens
    # [G] int64, the generated rows, where the step has both kinds and some matrix may take the GEMM
    # (else None: no row of it ever does where the two kinds mix)
    generated: torch.Tensor | None = None

    def slice(self, start: int, stop: int) -> StepRows:
        """The rows [start, stop) of the step (a long prefill's MLP, a chunk at a time)."""
        if self.generated is None:
            return StepRows(min(self.num_prompt, stop - start))
        inside = self.generated[(self.generated >= start) & (self.generated < stop)] - start
        return StepRows(stop - start - inside.numel(), inside if inside.numel() else None)


GENERATED_ROWS = StepRows(0)  # every row a generated token's (sampling rows): the panels alone


class WeightLayout(enum.Enum):
    """How a `Linear` stores its weight; the loader picks one per device and dtype (`weight_layout`)."""

    OUT_IN = "out_in"  # [out, in] as checkpoints store it, applied with F.linear: any device and dtype
    IN_OUT = "in_out"  # contiguous [in, out], applied as x @ W: CPU float32 without weft's kernels
    PANELS = "panels"  # [ceil(out / 32), in, 32] column panels for weft's packed_linear: CPU, any float
    BLOCKS = "blocks"  # GGUF blocks, flat uint8, multiplied by the kernel set (`block_linear`): CUDA
    FILE = "file"  # the GGUF file's own blocks, read from its pages (`file_linear`): CPU, `Linear.file`


class Linear(nn.Module):
    """`y = x @ W.T + b`. The weight is loaded in the Hugging Face [out, in] layout (`OUT_IN`); the
    loader then moves it to the layout that streams fastest on the device (`weight_layout`).

    Measured on the 2-core CPU machines over the weights of a SmolLM2-135M shaped model
    (docs/benchmarks.md), in float32: weft's panel kernel (`PANELS`) against `x @ W` on [in, out]
    is 1.0-1.1x at 1 row, 1.4-1.8x at 2-16 rows, 1.3x at 32 and 1.05x at 256; from ~1,000 rows MKL is
    faster and panels go through it (`DENSE_PANEL_ROWS`); `x @ W` on
    [in, out] is itself 1.2-1.4x `F.linear` on [out, in]. Half-precision weights take the same panels
    (float32 activations, the weights widened as they stream in): 2.3x the float32 panels at one row,
    and 4-10x torch's bfloat16 `F.linear` from 8 rows up on CPUs without AVX512_BF16. Without weft's
    kernels, half precision keeps [out, in] and a single bfloat16 row goes through `torch.mv`.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = False) -> None:
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features  # the panel layout pads it to a multiple of 32
        self.dense_rows = DENSE_PANEL_ROWS  # PANELS: from this many rows, the BLAS GEMM (prefill_gemm.py)
        self.bf16_dot = False  # bfloat16 PANELS: x rounded to bfloat16, bfloat16 products (linear.cpp)
        self.quantized: str | None = None  # "q8_0", "q4_k", "q6_k": quantized PANELS (model/quantized.py)
        self.weight = nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False) if bias else None
        self.layout = WeightLayout.OUT_IN
        self.blocks: BlockWeight | None = None  # BLOCKS: the parts and the kernel set that multiplies them
        self.parts: tuple[PanelPart, ...] | None = None  # PANELS in parts of several dot layouts
        self.file: FileWeight | None = None  # FILE: the parts, views of the file's mapping

    def set_layout(self, layout: WeightLayout) -> None:
        """Store the weight in `layout` (from [out, in]; a tied weight is no longer shared)."""
        if self.layout is not WeightLayout.OUT_IN:
            raise ValueError(f"Linear weight is already in the {self.layout.value} layout")
        if layout is WeightLayout.BLOCKS:
            raise ValueError("a matrix takes the blocks layout only as it is read in blocks (expect_blocks)")
        if layout is WeightLayout.FILE:
            raise ValueError("a matrix takes the file layout only as it is read from a GGUF file")
        if layout is WeightLayout.IN_OUT:
            self.weight = nn.Parameter(self.weight.t().contiguous(), requires_grad=False)
        elif layout is WeightLayout.PANELS:  # the activations, and so the bias, are float32
            self.weight = nn.Parameter(torch.ops.weft.pack_linear_weight(self.weight), requires_grad=False)
            if self.bias is not None:
                self.bias = nn.Parameter(self.bias.float(), requires_grad=False)
        self.layout = layout

    def expect_panels(self, shape: torch.Size, quantized: str | None = None) -> None:
        """Built on the meta device, to be assigned a weight that is already packed (a tied table
        packed as it is read, a quantized matrix): take the panels' `shape` without packing anything."""
        self.weight = nn.Parameter(torch.empty(shape, device="meta"), requires_grad=False)
        self.layout = WeightLayout.PANELS
        self.quantized = quantized

    def expect_parts(self, parts: tuple[PanelPart, ...], numel: int, label: str) -> None:
        """Built on the meta device, to be assigned a fused matrix in dot panels of several layouts
        (`PartedRows`: flat int8 [numel]), each part multiplied into its columns of the output."""
        self.weight = nn.Parameter(torch.empty(numel, dtype=torch.int8, device="meta"), requires_grad=False)
        self.layout = WeightLayout.PANELS
        self.parts = parts
        self.quantized = label

    def expect_file(self, file: FileWeight, label: str) -> None:
        """Built on the meta device, to be assigned the first of `file`'s parts (uint8 [rows, bytes]):
        multiplied in the GGUF file's own blocks, every part as it lies in the file's mapping."""
        placeholder = torch.empty(file.parts[0].shape, dtype=torch.uint8, device="meta")
        self.weight = nn.Parameter(placeholder, requires_grad=False)
        self.layout = WeightLayout.FILE
        self.file = file
        self.quantized = label

    def expect_blocks(self, blocks: BlockWeight, num_bytes: int, label: str) -> None:
        """Built on the meta device, to be assigned a matrix in GGUF blocks (flat uint8 [num_bytes])."""
        placeholder = torch.empty(num_bytes, dtype=torch.uint8, device="meta")
        self.weight = nn.Parameter(placeholder, requires_grad=False)
        self.layout = WeightLayout.BLOCKS
        self.blocks = blocks
        self.quantized = label

    def forward(
        self, x: torch.Tensor | BFloat16Pairs, rows: StepRows | None = None
    ) -> torch.Tensor:  # [T, in] -> [T, out]
        """`rows`: which of the step's rows hold prompt tokens (None: every row, as in scoring)."""
        if self.blocks is not None:
            assert isinstance(x, torch.Tensor)
            return self.blocks.kernels.block_linear(
                x, self.weight, self.blocks.parts, self.out_features, self.bias
            )
        if self.file is not None:
            assert isinstance(x, torch.Tensor)
            out = torch.ops.weft.file_linear(x, list(self.file.parts), list(self.file.kinds))
            return out if self.bias is None else out.add_(self.bias)
        if isinstance(x, BFloat16Pairs):  # rounded already: bfloat16 products (bf16_dot panels)
            words, count = x.words, x.num_rows
            return torch.ops.weft.packed_linear_pairs(words, count, self.weight, self.bias, self.out_features)
        if self.layout is WeightLayout.PANELS:
            num_prompt = x.shape[0] if rows is None else rows.num_prompt
            if num_prompt >= self.dense_rows and self.takes_gemm:  # long: BLAS GEMM
                return self.dense_forward(x, None if rows is None else rows.generated)
            return self.panel_forward(x)
        if self.layout is WeightLayout.IN_OUT:
            return x @ self.weight if self.bias is None else torch.addmm(self.bias, x, self.weight)
        if x.shape[0] == 1 and x.dtype == torch.bfloat16 and x.device.type == "cpu":
            out = torch.mv(self.weight, x[0]).unsqueeze(0)
            return out if self.bias is None else out + self.bias
        return F.linear(x, self.weight, self.bias)

    @property
    def takes_gemm(self) -> bool:
        """Whether long steps multiply through the BLAS GEMM (`dense_rows`): float panels, neither
        bfloat16 products nor quantized."""
        return self.layout is WeightLayout.PANELS and not (self.bf16_dot or self.quantized)

    def panel_forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, in] -> [T, out], PANELS only
        if self.parts is not None:
            return self._parted_forward(x)
        return torch.ops.weft.packed_linear(x, self.weight, self.bias, self.out_features, self.bf16_dot)

    def _parted_forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, in] -> [T, out]
        out = x.new_empty(x.shape[0], self.out_features)
        for panels, columns in self.part_panels():
            bias = None if self.bias is None else self.bias[columns]
            rows = columns.stop - columns.start
            out[:, columns] = torch.ops.weft.packed_linear(x, panels, bias, rows, False)
        return out

    def part_panels(self) -> list[tuple[torch.Tensor, slice]]:
        """Each part's dot panels (a view of the flat weight, [P, blocks, block bytes]) and its
        columns of the output (`PartedRows`)."""
        views = []
        for part in self.parts or ():
            panels = self.weight[part.start : part.start + math.prod(part.shape)].view(part.shape)
            views.append((panels, slice(part.out_start, part.out_start + part.rows)))
        return views

    def dense_forward(
        self, x: torch.Tensor, generated: torch.Tensor | None = None
    ) -> torch.Tensor:  # [T, in] -> [T, out], PANELS only
        """`generated` ([G] int64): rows computed through the panels all the same (`StepRows`)."""
        dense = self._dense_from_panels(x.shape[1])  # [in, out] float32
        out = torch.mm(x, dense) if self.bias is None else torch.addmm(self.bias, x, dense)
        if generated is not None:
            out[generated] = self.panel_forward(x[generated])
        return out

    def _dense_from_panels(self, in_features: int) -> torch.Tensor:
        """W.T as float32 [in, out] from the panels (half precision widened exactly), a copy made for
        one call and dropped after it: memory stays one copy of the weights."""
        panels = self.weight  # [P, K', 32]
        num_panels, rows, width = panels.shape
        dense = torch.empty(rows, num_panels * width)  # [K', P * 32]
        if panels.dtype == torch.bfloat16:  # input features in pairs (see weft/native/linear.cpp)
            pairs = panels.view(num_panels, rows // 2, width, 2).permute(1, 3, 0, 2)
            dense.view(rows // 2, 2, num_panels, width).copy_(pairs)
        else:
            dense.view(rows, num_panels, width).copy_(panels.permute(1, 0, 2))
        return dense[:in_features, : self.out_features]


# The default of `Linear.dense_rows` (the lm_head keeps it; the loader measures the others per machine
# and shape, weft/model/prefill_gemm.py): steps of at least this many rows multiply through a dense
# float32 copy of the panels made per call (torch's BLAS GEMM, MKL or oneDNN): on the 2-core AVX-512
# machine, for the SmolLM2-135M shapes, 1.2-1.5x faster than the panels at 1,024-4,096 rows counting
# the copy, even at 512, slower below (docs/benchmarks.md). Decode steps never come near it.
DENSE_PANEL_ROWS = 1024


@dataclass(frozen=True, slots=True)
class FileWeight:
    """A matrix kept in the GGUF file's own blocks (`WeightLayout.FILE`): its parts, uint8 [rows,
    bytes] views of the file's mapping stacked by rows, and each part's kind as `file_linear`
    codes it (weft/native/file_dot.cpp)."""

    parts: tuple[torch.Tensor, ...]
    kinds: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class BlockWeight:
    """A matrix kept in GGUF blocks (`WeightLayout.BLOCKS`): its parts, each of one kind, and the
    kernel set that multiplies (or looks up) them."""

    parts: tuple[BlockPart, ...]
    kernels: TorchKernels


class Embedding(nn.Module):
    """Token embeddings, a [vocab, hidden] table. When the table is tied to an lm_head whose weight
    was packed into panels (`read_from_panels`), the lookup reads the panels and the table is not
    kept a second time; an untied quantized table is kept in dot panels of its own
    (`expect_panels`)."""

    def __init__(self, num_embeddings: int, embedding_dim: int) -> None:
        super().__init__()
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.weight = nn.Parameter(torch.empty(num_embeddings, embedding_dim), requires_grad=False)
        self.from_panels = False
        self.blocks: BlockWeight | None = None  # a table in GGUF blocks, its rows dequantized per lookup

    def expect_blocks(self, blocks: BlockWeight, num_bytes: int) -> None:
        """Built on the meta device, to be assigned a table in GGUF blocks (flat uint8 [num_bytes])."""
        placeholder = torch.empty(num_bytes, dtype=torch.uint8, device="meta")
        self.weight = nn.Parameter(placeholder, requires_grad=False)
        self.blocks = blocks

    def expect_panels(self, shape: torch.Size) -> None:
        """Built on the meta device, to be assigned a table of its own in dot panels (an untied
        quantized table, int8 products), which the lookup reads."""
        self.weight = nn.Parameter(torch.empty(shape, dtype=torch.int8, device="meta"), requires_grad=False)
        self.from_panels = True

    def read_from_panels(self, lm_head: Linear) -> None:
        """Share the packed weight of `lm_head` (tied to this table) and look tokens up in it."""
        if lm_head.layout is not WeightLayout.PANELS:
            raise ValueError("read_from_panels needs an lm_head in the panels layout")
        self.weight = lm_head.weight
        self.from_panels = True

    def forward(self, ids: torch.Tensor) -> torch.Tensor:  # [T] int64 -> [T, hidden]
        if self.blocks is not None:  # float32 rows: the model casts them to its activations' dtype
            return self.blocks.kernels.block_rows(self.weight, self.blocks.parts, ids, torch.float32)
        if self.from_panels:
            return torch.ops.weft.embedding_from_panels(
                ids, self.weight, self.num_embeddings, self.embedding_dim
            )
        return F.embedding(ids, self.weight)


def weight_layout(kernels: TorchKernels, device: torch.device, dtype: torch.dtype) -> WeightLayout:
    """The `Linear` weight layout for a model on `device` in `dtype` (see `Linear`)."""
    if kernels.packs_linear_weights(device, dtype):
        return WeightLayout.PANELS
    return WeightLayout.IN_OUT if device.type == "cpu" and dtype == torch.float32 else WeightLayout.OUT_IN


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, kernels: TorchKernels = TORCH_KERNELS) -> None:
        super().__init__()
        self.eps = eps
        self.kernels = kernels
        self.weight = nn.Parameter(torch.ones(dim), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., dim]
        return self.kernels.rms_norm(x, self.weight, self.eps)

    def add_residual_(self, x: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
        """x += delta in place ([T, dim], the residual stream); returns this norm of the sum (one
        kernel where the kernel set fuses them)."""
        return self.kernels.add_rms_norm_(x, delta, self.weight, self.eps)

    def add_normed_(self, x: torch.Tensor, delta: torch.Tensor, next_norm: RMSNorm | None) -> torch.Tensor:
        """x += this norm of delta in place ([T, dim], a post-norm branch's output into the residual
        stream); returns `next_norm` of the sum, or x itself without one (one kernel where fused)."""
        next_weight = None if next_norm is None else next_norm.weight
        return self.kernels.add_normed_(x, delta, self.weight, next_weight, self.eps)

    def pairs_(self, x: torch.Tensor, delta: torch.Tensor | None = None) -> BFloat16Pairs:
        """This norm of x (after x += delta in place, where delta is given) as the bfloat16 pairs of
        the bfloat16 products after it: float32 [T, dim] rows, weft's CPU kernels."""
        return BFloat16Pairs(torch.ops.weft.add_rms_norm_pairs_(x, delta, self.weight, self.eps), x.shape[0])


def rotary_dims(head_dim: int, rope: RopeConfig) -> int:
    """How many of a head's dimensions rotate (all but with a `partial_rotary_factor`)."""
    return int(head_dim * rope.partial_rotary_factor)


def rope_inv_freq(
    head_dim: int, rope: RopeConfig, max_positions: int | None = None
) -> torch.Tensor:  # [head_dim // 2] float32
    """Each rotating pair's frequency, then 0 for the pairs that pass through (a partial rotary
    embedding, whose q and k dimensions the loader reorders: `partial_rotary_order`).
    `max_positions`: the context, which picks LongRoPE's long factors where it is longer than the
    original one (as llama.cpp does; transformers switches per forward)."""
    dims = rotary_dims(head_dim, rope)
    exponents = torch.arange(0, dims, 2, dtype=torch.float64, device="cpu") / dims  # [R/2]
    inv_freq = 1.0 / (rope.theta**exponents)
    if rope.rope_type == RopeType.LINEAR:
        inv_freq = inv_freq / rope.factor
    elif rope.rope_type == RopeType.LLAMA3:
        inv_freq = _llama3_scaled(inv_freq, rope)
    elif rope.rope_type == RopeType.YARN:
        inv_freq = _yarn_scaled(inv_freq, dims, rope)
    elif rope.rope_type == RopeType.LONGROPE:
        long = max_positions is not None and max_positions > rope.original_max_position_embeddings
        factors = rope.long_factor if long else rope.short_factor
        if len(factors) != dims // 2:
            raise ConfigError(f"rope scaling longrope: {len(factors)} factors for {dims // 2} rotating pairs")
        inv_freq = inv_freq / torch.tensor(factors, dtype=torch.float64, device="cpu")
    if rope.freq_factors:
        inv_freq = inv_freq / torch.tensor(rope.freq_factors, dtype=torch.float64, device="cpu")
    padded = torch.zeros(head_dim // 2, dtype=torch.float64, device="cpu")
    padded[: dims // 2] = inv_freq
    return padded.float()


def partial_rotary_order(head_dim: int, rotary: int) -> torch.Tensor:  # [head_dim] int64
    """Where each of a head's dimensions moves so that a partial rotary embedding (the first
    `rotary` dimensions, rotating i with i + rotary/2) becomes weft's whole-head one (i with i +
    head_dim/2, the pairs past rotary/2 rotating by nothing): q and k rows reordered alike keep
    every q.k, and v is not touched."""
    half, rest = rotary // 2, (head_dim - rotary) // 2
    first = [*range(half), *range(rotary, rotary + rest)]
    second = [*range(half, rotary), *range(rotary + rest, head_dim)]
    return torch.tensor(first + second)


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


def _yarn_scaled(inv_freq: torch.Tensor, head_dim: int, rope: RopeConfig) -> torch.Tensor:
    """YaRN (as transformers and llama.cpp compute it): frequencies that turn more than `beta_fast`
    times over the original context are kept, those that turn fewer than `beta_slow` times are
    divided by `factor`, and a linear ramp over the dimensions between blends the two."""

    def dimension(rotations: float) -> float:  # the dimension whose frequency turns this many times
        old_len = rope.original_max_position_embeddings
        return head_dim * math.log(old_len / (rotations * 2 * math.pi)) / (2 * math.log(rope.theta))

    low, high = dimension(rope.beta_fast), dimension(rope.beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001
    dims = torch.arange(head_dim // 2, dtype=torch.float64, device="cpu")
    ramp = ((dims - low) / (high - low)).clamp(0, 1)  # [D/2]
    return inv_freq / rope.factor * ramp + inv_freq * (1 - ramp)


class RotaryEmbedding(nn.Module):
    """Rotary position embedding in the half-split ("rotate_half") layout used by Llama-family
    checkpoints on Hugging Face."""

    cos: torch.Tensor  # [max_positions, D/2] float32
    sin: torch.Tensor  # [max_positions, D/2] float32

    def __init__(
        self,
        head_dim: int,
        max_positions: int,
        rope: RopeConfig,
        device: torch.device | None = None,
        kernels: TorchKernels = TORCH_KERNELS,
    ):
        super().__init__()
        self.kernels = kernels
        inv_freq = rope_inv_freq(head_dim, rope, max_positions)  # [D/2]
        # computed on the CPU even inside a meta-device context (the loader builds the model there)
        steps = torch.arange(max_positions, dtype=torch.float32, device="cpu")
        angles = torch.outer(steps, inv_freq)  # [P, D/2]
        scale = 1.0 if rope.attention_factor is None else rope.attention_factor  # YaRN's, LongRoPE's
        cos, sin = angles.cos(), angles.sin()
        if scale != 1.0:  # the rotating pairs only: the others pass through as they are
            pairs = rotary_dims(head_dim, rope) // 2
            cos[:, :pairs] *= scale
            sin[:, :pairs] *= scale
        # plain attributes, not buffers: the tables stay float32 when the model moves to half precision
        self.cos = cos.to(device)  # [P, D/2]
        self.sin = sin.to(device)  # [P, D/2]

    def tables(self, positions: torch.Tensor, dtype: torch.dtype) -> RopeTables:
        """The rotation of one step's tokens at `positions` ([T] int64), shared by all layers."""
        return self.kernels.rope_tables(self.cos, self.sin, positions, dtype)


__all__ = [
    "BlockWeight",
    "Embedding",
    "Linear",
    "RMSNorm",
    "RopeTables",
    "RotaryEmbedding",
    "WeightLayout",
    "weight_layout",
]
