"""The one device-to-host transfer of an engine step.

Everything the host needs from a step travels in one tensor, through one call of `to_host`: the
sampled token ids and, when some row asked for them, blocks of logprobs (the sampled tokens' and
the prompt tokens'), each row of a block being (rank, k+1 ids, k+1 logprobs). On CUDA it goes
through pinned memory with a non-blocking copy and one wait on the stream; on CPU it is a plain
conversion. Nothing else in a step reads a device tensor back.
"""

from __future__ import annotations

from typing import Any

import torch


def to_host(tensor: torch.Tensor) -> list[Any]:
    """`tensor` as (nested) Python lists: the step's single device-to-host transfer."""
    if tensor.device.type == "cpu":
        return tensor.tolist()
    pinned = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
    pinned.copy_(tensor, non_blocking=True)
    torch.cuda.current_stream(tensor.device).synchronize()
    return pinned.tolist()


def logprob_block(
    top_ids: torch.Tensor,  # [R, k+1] int64, the actual or sampled token first
    top_logprobs: torch.Tensor,  # [R, k+1] float32
    ranks: torch.Tensor,  # [R] int64
    extra: torch.Tensor | None = None,  # [R] float32, one more value per row (0 when None)
) -> torch.Tensor:  # [R, 2 + 2 (k+1)] float64
    """Rows of (rank, extra, k+1 ids, k+1 logprobs); float64 holds every id, rank and float32
    exactly."""
    extra_column = ranks.new_zeros(ranks.shape, dtype=torch.float64) if extra is None else extra.double()
    columns = [ranks[:, None].double(), extra_column[:, None], top_ids.double(), top_logprobs.double()]
    return torch.cat(columns, dim=1)


def pack(token_ids: torch.Tensor, blocks: list[torch.Tensor]) -> torch.Tensor:
    """One tensor for the transfer: the [B] int64 ids alone, or one float64 vector of the ids
    followed by each block, flattened."""
    if not blocks:
        return token_ids
    return torch.cat([token_ids.double(), *(b.flatten() for b in blocks)])


def unpack(flat: list[Any], num_ids: int, shapes: list[tuple[int, int]]) -> tuple[list[int], list[list[Any]]]:
    """The host side of `pack`: the ids, and each block as rows of (ids [k+1], logprobs [k+1], rank,
    extra)."""
    if not shapes:  # the ids alone, as ints already
        return flat, []
    token_ids = [int(t) for t in flat[:num_ids]]
    blocks, offset = [], num_ids
    for num_rows, width in shapes:
        k = (width - 2) // 2
        rows = []
        for i in range(num_rows):
            chunk = flat[offset + i * width : offset + (i + 1) * width]
            rows.append((list(map(int, chunk[2 : 2 + k])), chunk[2 + k :], int(chunk[0]), chunk[1]))
        blocks.append(rows)
        offset += num_rows * width
    return token_ids, blocks
