"""CUDA graphs for decode steps: the model's forward captured once per padded batch size over static
input buffers, and replayed when a step is decode-only and fits a size.

At batch 1 a decode step is about 330 kernel launches, and the launches, not the bytes read, set
its time; a replay launches them all at once. Steps in order:

1. `capture` (at load): for each size of `capture_sizes(max_num_seqs)`, largest first, sharing one
   memory pool: run the forward eagerly on the static buffers (warm-up: Triton compiles here, never
   inside a capture), capture it, replay it and check the replay against the eager output (a
   mismatch turns graphs off with a warning instead of giving wrong tokens).
2. `run` (each step): a step whose rows are all single tokens and whose batch fits a size copies its
   inputs (token ids, positions, slots, block table, lengths) into the first rows of the static
   buffers and points the padding rows at the scratch block (the kernel set's `stage_decode_rows`:
   one launch on CUDA), replays, and returns the first rows of the static output. Anything else
   (prompt chunks, forced tokens, more rows than the largest size) returns None and runs eagerly.

Padding rows must not write into a real block: they read and write the scratch block, one block
past the KV manager's pool that no sequence is ever given (`ModelRunner` allocates it).

The capture itself is a parameter (`Capture`): `cuda_capture` records a `torch.cuda.CUDAGraph`;
tests on CPU pass `eager_capture`, which replays by running the forward again on the same static
buffers, so everything but the graph itself (buffers, padding, size choice) is tested without a GPU.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import torch

from weft.kernels import DecodeRows, RaggedBatch
from weft.model.attention import AttentionMetadata
from weft.model.llama import KVCache, LlamaForCausalLM

Forward = Callable[[], torch.Tensor]  # the forward on the static buffers -> [size, hidden]
Capture = Callable[[Forward, Any], Forward]  # (forward, pool) -> replay


def capture_sizes(max_num_seqs: int) -> list[int]:
    """Padded batch sizes: 1, 2, 4, then the multiples of 8 below max_num_seqs, then max_num_seqs."""
    small = [size for size in (1, 2, 4) if size < max_num_seqs]
    return [*small, *range(8, max_num_seqs, 8), max_num_seqs]


def cuda_capture(forward: Forward, pool: Any) -> Forward:
    """Record `forward` into a CUDA graph (in `pool`); the replay returns the captured output."""
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        out = forward()

    def replay() -> torch.Tensor:
        graph.replay()
        return out

    return replay


def eager_capture(forward: Forward, pool: Any) -> Forward:
    """No graph: replay runs the forward again on the static buffers (CPU tests of this module)."""
    return forward


@dataclass(frozen=True, slots=True)
class CaptureReport:
    sizes: list[int]
    seconds: float
    memory_bytes: int  # device memory the graphs' pool took (0 off CUDA)


class DecodeGraphs:
    """Static buffers and one captured forward per padded batch size (see the module docstring)."""

    def __init__(
        self,
        model: LlamaForCausalLM,
        kv_caches: list[KVCache],
        scratch_block: int,
        block_size: int,
        max_model_len: int,
        max_num_seqs: int,
        window_scratch: int | None = None,
    ) -> None:
        self.model, self.kv_caches = model, kv_caches
        self.scratch_block, self.block_size = scratch_block, block_size
        self.sizes = capture_sizes(max_num_seqs)
        device, max_size = kv_caches[0].device, self.sizes[-1]
        max_blocks = -(-max_model_len // block_size)
        self.input_ids = torch.zeros(max_size, dtype=torch.int64, device=device)  # [Bmax]
        self.positions = torch.zeros(max_size, dtype=torch.int64, device=device)  # [Bmax]
        # Every row starts as a padding row (`stage_decode_rows`): the scratch block's first slot, length 1.
        scratch_slot = scratch_block * block_size
        self.slot_mapping = torch.full((max_size,), scratch_slot, dtype=torch.int64, device=device)  # [Bmax]
        self.block_table = torch.full((max_size, max_blocks), scratch_block, dtype=torch.int32, device=device)
        self.seq_lens = torch.ones(max_size, dtype=torch.int32, device=device)  # [Bmax]
        self.query_start = torch.arange(max_size + 1, dtype=torch.int32, device=device)  # [Bmax + 1]
        # the sliding-window layers' own pool (`window_scratch`: its scratch block), where there is one
        self.window: WindowBuffers | None = None
        if window_scratch is not None:
            self.window = WindowBuffers.full(window_scratch, block_size, max_blocks, max_size, device)
        self.replays: dict[int, Forward] = {}
        tables = (self.slot_mapping, self.block_table, self.seq_lens)
        self.rows = DecodeRows(self.input_ids, self.positions, *tables)  # what `run` fills

    def capture(self, capture: Capture, pool: Any = None, progress: bool = False) -> CaptureReport:
        """Capture every size, largest first; raises RuntimeError if a replay differs from eager."""
        start, used_before = time.perf_counter(), _memory_in_use(self.input_ids.device)
        for i, size in enumerate(reversed(self.sizes)):
            forward = self._forward(size)
            expected = forward().clone()  # warm-up, and the reference for the replay
            replay = capture(forward, pool)
            tol = 1e-4 if expected.dtype == torch.float32 else 5e-2
            if not torch.allclose(replay(), expected, rtol=tol, atol=tol):
                raise RuntimeError(f"the decode graph of batch size {size} replays differently from eager")
            self.replays[size] = replay
            if progress:
                print(f"\rweft: capturing decode graphs {i + 1}/{len(self.sizes)}", end="", file=sys.stderr)
        if progress:
            print(file=sys.stderr)
        memory = _memory_in_use(self.input_ids.device) - used_before
        return CaptureReport(list(self.sizes), time.perf_counter() - start, memory)

    def run(
        self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor | None:  # [B, hidden], or None: run this step eagerly
        batch = meta.ragged
        if batch is None or batch.max_query_len != 1:
            return None
        num_rows = input_ids.shape[0]
        size = next((s for s in self.sizes if s >= num_rows), None)
        if size is None:
            return None
        kernels = self.model.kernels
        step = DecodeRows(input_ids, positions, meta.slot_mapping, batch.block_table, batch.seq_lens)
        kernels.stage_decode_rows(self.rows, step, size, self.scratch_block, self.block_size)
        if self.window is not None:
            sliding = meta.sliding
            assert sliding is not None and sliding.ragged is not None, "a window pool's step, no tables"
            own = DecodeRows(None, None, sliding.slot_mapping, sliding.ragged.block_table, None)
            kernels.stage_decode_rows(self.window.rows, own, size, self.window.scratch, self.block_size)
        return self.replays[size]()[:num_rows]

    def _forward(self, size: int) -> Forward:
        batch = RaggedBatch(self.block_table[:size], self.seq_lens[:size], self.query_start[: size + 1], 1)
        sliding = None
        if self.window is not None:
            window = self.model.attention.window
            own = RaggedBatch(self.window.table[:size], self.seq_lens[:size], self.query_start[: size + 1], 1)
            sliding = AttentionMetadata(self.window.slots[:size], (), replace(own, window=window))
        meta = AttentionMetadata(self.slot_mapping[:size], (), batch, sliding)
        input_ids, positions = self.input_ids[:size], self.positions[:size]
        return lambda: self.model(input_ids, positions, self.kv_caches, meta)


@dataclass(frozen=True, slots=True)
class WindowBuffers:
    """The static inputs of the sliding-window layers' own pool (`weft/engine/window_blocks.py`):
    each row's slot and block table there, padding rows on the pool's `scratch` block."""

    scratch: int
    slots: torch.Tensor  # [Bmax] int64
    table: torch.Tensor  # [Bmax, max_blocks] int32

    @staticmethod
    def full(
        scratch: int, block_size: int, max_blocks: int, max_size: int, device: torch.device
    ) -> WindowBuffers:
        slots = torch.full((max_size,), scratch * block_size, dtype=torch.int64, device=device)
        table = torch.full((max_size, max_blocks), scratch, dtype=torch.int32, device=device)
        return WindowBuffers(scratch, slots, table)

    @property
    def rows(self) -> DecodeRows:
        return DecodeRows(None, None, self.slots, self.table, None)


def _memory_in_use(device: torch.device) -> int:
    return torch.cuda.memory_allocated(device) if device.type == "cuda" else 0
