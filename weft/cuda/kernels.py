"""`TritonKernels`: the kernel set of CUDA devices (see `weft/kernels.py` for the protocol).

What it replaces in `TorchKernels`, and why:
- attention: one launch for every row of a step, reading the paged cache in place
  (`cuda/attention.py`), instead of gathering each sequence's blocks and running a masked SDPA
  over the copy (close to half of the GPU time at batch 256);
- RMSNorm, the residual add before it, SiLU-and-multiply, and the rotary embedding with the
  KV-cache write: one launch each (`cuda/elementwise.py`), where torch takes 3-6 kernels and
  temporaries (at batch 1 a step is about 330 launches, and launches, not bytes, set its time);
- linear layers over GGUF blocks (Q8_0, Q4_0, Q5_0, Q4_1, Q5_1, Q2_K, Q4_K, Q5_K, Q6_K, IQ4_XS):
  the blocks stay on the device and each tile is dequantized in the kernel as it streams
  (`cuda/quant.py`; decode rows `cuda/block_gemv.py` and `cuda/block_gemv_q8.py`), where a float
  copy of the weights would take 3.5-7x their memory and bandwidth;
- the logprobs of sampled and prompt tokens (chosen, rank, top n): three launches
  (`cuda/logprobs.py`) where tensor operations take about 25; greedy tokens, one
  (`cuda/greedy.py`) where they take five; a replayed decode graph's inputs, one
  (`cuda/graph_rows.py`) where copies and fills take eight.

Float linear layers stay cuBLAS (`F.linear`); everything else (sampling, the bitmask) is the torch
version, which runs on the device without a host sync.
"""

from __future__ import annotations

import torch

from weft.cuda import attention, elementwise, graph_rows, greedy, logprobs, quant
from weft.kernels import BlockPart, DecodeRows, RaggedBatch, RopeTables, TorchKernels

MAX_HEAD_DIM = 256


class TritonKernels(TorchKernels):
    """Triton kernels for tensors of a CUDA device (or CPU tensors under `TRITON_INTERPRET=1`)."""

    name = "triton"

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        if x.dim() != 2 or x.stride(1) != 1:
            return super().rms_norm(x, weight, eps)
        return elementwise.rms_norm(x, weight, eps)

    def add_rms_norm_(
        self, x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> torch.Tensor:
        if x.dim() != 2 or x.stride(1) != 1 or delta.stride(1) != 1:
            return super().add_rms_norm_(x, delta, weight, eps)
        return elementwise.add_rms_norm_(x, delta, weight, eps)

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        if gate_up.dim() != 2 or gate_up.stride(1) != 1:
            return super().silu_mul(gate_up)
        return elementwise.silu_mul(gate_up)

    def stage_decode_rows(
        self, static: DecodeRows, step: DecodeRows, size: int, pad_block: int, block_size: int
    ) -> None:
        graph_rows.stage_decode_rows(static, step, size, pad_block, block_size)

    def greedy_tokens(self, x: torch.Tensor, invalid: int) -> torch.Tensor:
        if x.dtype != torch.float32 or x.dim() != 2 or x.stride(1) != 1 or x.shape[1] == 0:
            return super().greedy_tokens(x, invalid)
        return greedy.greedy_tokens(x, invalid)

    def row_logprobs(
        self, x: torch.Tensor, ids: torch.Tensor, num_top: int, norm: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        if x.dtype != torch.float32 or x.dim() != 2 or x.stride(1) != 1 or x.shape[1] == 0:
            return super().row_logprobs(x, ids, num_top, norm)
        norm = None if norm is None else norm.contiguous()
        return logprobs.row_logprobs(x, ids.contiguous(), num_top, norm)

    block_kinds = frozenset(quant.KINDS)

    def multiplies_blocks(self, device: torch.device) -> bool:
        return True  # CUDA, or CPU tensors in Triton's interpreter

    def block_linear(
        self,
        x: torch.Tensor,
        weight: torch.Tensor,
        parts: tuple[BlockPart, ...],
        out_features: int,
        bias: torch.Tensor | None,
    ) -> torch.Tensor:
        return quant.quantized_linear(x, weight, parts, out_features, bias)

    def block_rows(
        self, weight: torch.Tensor, parts: tuple[BlockPart, ...], ids: torch.Tensor, dtype: torch.dtype
    ) -> torch.Tensor:
        return quant.dequantize_rows(weight, parts, ids, dtype)

    def rope_tables(
        self, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor, dtype: torch.dtype
    ) -> RopeTables:
        return RopeTables(positions, cos, sin)  # the kernel looks the positions up itself

    def apply_rope_(self, x: torch.Tensor, rope: RopeTables) -> None:
        elementwise.rope_(x, rope.positions, rope.cos, rope.sin)

    def rope_write_kv_(
        self,
        qkv: torch.Tensor,
        num_heads: int,
        rope: RopeTables,
        kv_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
    ) -> None:
        fused = qkv.stride(2) == 1 and kv_cache.is_contiguous() and kv_cache.dtype == qkv.dtype
        if not fused or qkv.shape[2] % 2:
            return super().rope_write_kv_(qkv, num_heads, rope, kv_cache, slot_mapping)
        elementwise.rope_write_kv_(qkv, num_heads, rope.positions, rope.cos, rope.sin, kv_cache, slot_mapping)

    def takes_ragged_batch(self, head_dim: int, block_size: int) -> bool:
        """Block sizes of at least 16 (the smallest `tl.dot`), powers of two; head sizes up to 256."""
        power_of_two = block_size & (block_size - 1) == 0
        return head_dim <= MAX_HEAD_DIM and block_size >= attention.MIN_DOT_ROWS and power_of_two

    def ragged_paged_attention(
        self,
        q: torch.Tensor,
        kv_cache: torch.Tensor,
        batch: RaggedBatch,
        scale: float,
        sinks: torch.Tensor | None = None,
        softcap: float = 0.0,
    ) -> torch.Tensor:
        return attention.paged_attention(q, kv_cache, batch, scale, sinks, softcap)


TRITON_KERNELS = TritonKernels()
