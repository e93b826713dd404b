"""The one device-to-host transfer of an engine step.

Everything the host needs from a step (the sampled token ids and, when some row asked for them,
their logprobs, ranks and top-n alternatives) travels in one tensor, through one call of
`to_host`. On CUDA it goes through pinned memory with a non-blocking copy and one wait on the
stream; on CPU it is a plain conversion. Nothing else in a step reads a device tensor back.
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


def pack_sampled(
    token_ids: torch.Tensor,  # [B] int64
    top_ids: torch.Tensor | None = None,  # [R, k+1] int64, the sampled token first
    top_logprobs: torch.Tensor | None = None,  # [R, k+1] float32
    ranks: torch.Tensor | None = None,  # [R] int64
) -> torch.Tensor:
    """One tensor for the transfer: the [B] int64 ids without logprobs; with them one float64 vector,
    the B ids followed by R rows of (rank, k+1 ids, k+1 logprobs). float64 holds every id, rank and
    float32 exactly."""
    if top_ids is None or top_logprobs is None or ranks is None:
        return token_ids
    block = torch.cat(
        [ranks[:, None].to(torch.float64), top_ids.to(torch.float64), top_logprobs.to(torch.float64)], 1
    )
    return torch.cat([token_ids.to(torch.float64), block.flatten()])


def unpack_sampled(
    flat: list[float], num_rows: int, rows: tuple[int, ...], width: int
) -> tuple[list[int], list[Any]]:
    """The host side of `pack_sampled`: the B token ids, and for each batch row None or its
    (ids [k+1], logprobs [k+1], rank)."""
    token_ids = [int(t) for t in flat[:num_rows]]
    per_row: list[Any] = [None] * num_rows
    stride = 1 + 2 * width
    for j, row in enumerate(rows):
        chunk = flat[num_rows + j * stride : num_rows + (j + 1) * stride]
        per_row[row] = ([int(t) for t in chunk[1 : 1 + width]], chunk[1 + width :], int(chunk[0]))
    return token_ids, per_row
