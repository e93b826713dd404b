"""The one device-to-host transfer of an engine step.

Everything the host needs from a step travels in one tensor, through one call of `to_host`: the
sampled token ids and, when some row asked for them, blocks of logprobs (the sampled tokens' and
the prompt tokens'), each row of a block being (rank, extra, k+1 ids, k+1 logprobs). On CUDA it
goes through pinned memory with a non-blocking copy and one wait for that copy (`HostTransfer`);
on CPU the array shares the tensor's memory. Nothing else in a step reads a device tensor back.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch


class HostTransfer:
    """A device-to-host copy on its way: `wait()` gives the host array. On CUDA the copy goes into
    pinned memory without blocking, and only `wait()` waits (for this copy's event, not for work
    queued after it: a step launched meanwhile keeps running); on CPU the array is there at once."""

    __slots__ = ("_array", "_event")

    def __init__(self, array: np.ndarray, event: Any = None) -> None:
        self._array, self._event = array, event

    def wait(self) -> np.ndarray:
        if self._event is not None:
            self._event.synchronize()
            self._event = None
        return self._array


def to_host(tensor: torch.Tensor) -> HostTransfer:
    """Start copying `tensor` to the host: the step's single device-to-host transfer (on CPU the
    array shares the tensor's memory). Rows are split on the host with numpy, not element by element
    in Python."""
    if tensor.device.type == "cpu":
        return HostTransfer(tensor.numpy())
    pinned = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
    pinned.copy_(tensor, non_blocking=True)
    event = torch.cuda.Event()
    event.record(torch.cuda.current_stream(tensor.device))
    return HostTransfer(pinned.numpy(), event)


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


def unpack(
    flat: np.ndarray, num_ids: int, shapes: list[tuple[int, int]]
) -> tuple[list[int], list[np.ndarray]]:
    """The host side of `pack`: the ids, and each block as a [R, 2 + 2 (k+1)] float64 array (a view
    of `flat`; `weft.logprob_records` reads its rows)."""
    if not shapes:  # the ids alone
        return flat.tolist(), []
    token_ids = flat[:num_ids].astype(np.int64).tolist()
    blocks, offset = [], num_ids
    for num_rows, width in shapes:
        blocks.append(flat[offset : offset + num_rows * width].reshape(num_rows, width))
        offset += num_rows * width
    return token_ids, blocks
