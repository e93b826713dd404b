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
    top_ids: torch.Tensor | None = None,  # [B, k+1] int64, the sampled token first
    top_logprobs: torch.Tensor | None = None,  # [B, k+1] float32
    ranks: torch.Tensor | None = None,  # [B] int64
) -> torch.Tensor:
    """One tensor for the transfer: [B] int64 without logprobs, else [B, 2 + 2 (k+1)] float64 rows
    (token id, rank, k+1 ids, k+1 logprobs). float64 holds every id, rank and float32 exactly."""
    if top_ids is None or top_logprobs is None or ranks is None:
        return token_ids
    columns = [token_ids[:, None], ranks[:, None], top_ids, top_logprobs]
    return torch.cat([c.to(torch.float64) for c in columns], dim=1)
