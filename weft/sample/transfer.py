"""The one device-to-host transfer of an engine step.

Everything the host needs from a step travels in one tensor, through one call of `to_host`: the
sampled token ids and, when some row asked for them, blocks of logprobs (the sampled tokens' and
the known tokens' that the step computed), each row of a block being (rank, extra, k+1 ids, k+1
logprobs). On CUDA it goes through pinned memory with a non-blocking copy and one wait for that
copy (`HostTransfer`); on CPU the array shares the tensor's memory. Nothing else in a step reads a
device tensor back. `StepTransfer` owns both ends: it packs the step's results on the device
(`start`) and unpacks them on the host (`read`); no one else knows the layout.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np
import torch

from weft.logprob_records import LogprobRef, row_refs
from weft.outputs import LogprobsTensors
from weft.sample.sampler import INVALID_TOKEN

# A block of logprobs of known tokens, [R, k+1] ids, [R, k+1] logprobs and [R] ranks (column 0 is
# the token itself): prompt tokens and tokens a grammar forced.
KnownTokenLogprobs = tuple[torch.Tensor, torch.Tensor, torch.Tensor]


class StepResults(NamedTuple):
    """A step's results on the host, one entry per sampling row (fanout children last)."""

    token_ids: list[int]
    logprobs: list[LogprobRef | None]  # the sampled token's, for the rows that asked for them
    known_logprobs: list[LogprobRef]  # per known token whose logprobs the step computed, in order
    invalid_rows: list[int]  # rows whose logits were not finite: no token could be sampled


class StepTransfer:
    """A step's results on their way to the host: packed into one tensor on the device by `start`,
    split into Python values by `read` (which waits for the copy)."""

    __slots__ = ("_copy", "_has_known", "_logprob_rows", "_num_rows", "_shapes")

    def __init__(
        self,
        copy: HostTransfer,
        num_rows: int,
        shapes: list[tuple[int, int]],
        logprob_rows: tuple[int, ...],
        has_known: bool,
    ) -> None:
        self._copy, self._num_rows, self._shapes = copy, num_rows, shapes
        self._logprob_rows, self._has_known = logprob_rows, has_known

    @classmethod
    def start(
        cls,
        token_ids: torch.Tensor,  # [S] int64, sampled, INVALID_TOKEN where a row could not sample
        top: LogprobsTensors | None,
        known: KnownTokenLogprobs | None,
    ) -> StepTransfer:
        blocks = []
        if top is not None:
            blocks.append(logprob_block(top.token_ids, top.logprobs, top.ranks, top.constraint_logmass))
        if known is not None:
            blocks.append(logprob_block(*known))
        shapes = [(b.shape[0], b.shape[1]) for b in blocks]
        rows = () if top is None else top.rows
        return cls(to_host(pack(token_ids, blocks)), token_ids.shape[0], shapes, rows, known is not None)

    def read(self) -> StepResults:
        token_ids, blocks = unpack(self._copy.wait(), self._num_rows, self._shapes)
        logprobs: list[LogprobRef | None] = [None] * self._num_rows
        if self._logprob_rows:
            for row, ref in zip(self._logprob_rows, row_refs(blocks[0]), strict=True):
                logprobs[row] = ref
        known = row_refs(blocks[-1]) if self._has_known else []
        invalid = []
        if INVALID_TOKEN in token_ids:
            invalid = [row for row, token in enumerate(token_ids) if token == INVALID_TOKEN]
        return StepResults(token_ids, logprobs, known, invalid)


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
