"""Host arrays for the step: small per-row values gathered on the host with numpy (building a
torch tensor from a Python list costs several times more) and moved to the device: once each
(`to_device`), or on CUDA all of a step's in one copy (`StepUploads`)."""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence

import numpy as np
import torch


def to_device(array: np.ndarray, device: torch.device) -> torch.Tensor:
    """`array` as a tensor on `device` (shares the memory on CPU). On CUDA the copy goes through
    pinned memory (PyTorch's caching host allocator, which keeps a block until its copy is done) and
    does not wait: a copy from pageable memory would make the host wait for the device."""
    tensor = torch.from_numpy(np.ascontiguousarray(array))
    if device.type == "cuda":
        return tensor.pin_memory().to(device, non_blocking=True)
    return tensor.to(device)


def column(values: Sequence[float], dtype: np.dtype | type, device: torch.device) -> torch.Tensor:
    """A [B] tensor of host values."""
    return to_device(np.array(values, dtype=dtype), device)


def padded(rows: Sequence[Sequence[int]], pad: int, min_width: int = 0) -> np.ndarray:
    """[B, longest] int64 from ragged rows of ints, padded with `pad`, without a loop over rows."""
    lens = np.fromiter(map(len, rows), dtype=np.int64, count=len(rows))  # [B]
    width = max(min_width, int(lens.max()))
    if bool((lens == width).all()):
        return np.array(rows, dtype=np.int64).reshape(len(rows), width)
    flat = np.fromiter(itertools.chain.from_iterable(rows), dtype=np.int64, count=int(lens.sum()))
    cols = np.arange(len(flat)) - np.repeat(np.cumsum(lens) - lens, lens)
    out = np.full((len(rows), width), pad, dtype=np.int64)
    out[np.repeat(np.arange(len(rows)), lens), cols] = flat
    return out


Upload = Callable[[np.ndarray], torch.Tensor]  # a host array -> the same values on the device


class StepUploads:
    """A step's small host arrays moved to a CUDA device in one copy. `begin` starts a step; each
    `put` packs an array into a pinned staging buffer and returns the view of a device buffer where
    it will land; `send` copies everything put since `begin` at once (non-blocking). Nothing may
    read a view on the device before `send` (the runner sends before the forward).

    Where `to_device` pins each array and copies it on its own (about 40 us of host time each on a
    GPU machine, eight or more a step), a step here costs one copy. The staging buffers are a ring
    of two, each reused once the copy that last read it is done (an event), so that the host can
    prepare step N+1 while step N's copy still waits in the stream behind step N-1; a step that
    needs more room than a buffer has sends what it has, and continues in a buffer twice as big.
    """

    ALIGN = 16  # bytes: every array starts at a multiple, so that any dtype's view is aligned

    def __init__(self, device: torch.device, capacity: int = 1 << 16, ring: int = 2) -> None:
        self.device = device
        self.slots = [_StagingSlot(device, capacity) for _ in range(ring)]
        self.turn = 0
        self.slot = self.slots[0]
        self.used = 0

    def begin(self) -> Upload:
        self.turn = (self.turn + 1) % len(self.slots)
        self.slot = self.slots[self.turn]
        self.slot.wait()
        self.used = 0
        return self.put

    def put(self, array: np.ndarray) -> torch.Tensor:
        array = np.ascontiguousarray(array)
        size = array.nbytes
        if self.used + size > self.slot.capacity:
            self._grow(size)
        start = self.used
        self.slot.host_bytes[start : start + size] = array.reshape(-1).view(np.uint8)
        self.used = start + -(-size // self.ALIGN) * self.ALIGN
        view = self.slot.device_buffer[start : start + size]
        return view.view(_TORCH_DTYPES[array.dtype]).view(array.shape)

    def send(self) -> None:
        if self.used:
            self.slot.copy(self.used)

    def _grow(self, size: int) -> None:
        """Send what this step has put so far; go on in a new buffer big enough for `size` more."""
        self.send()
        capacity = max(2 * self.slot.capacity, 2 * size)
        self.slots[self.turn] = self.slot = _StagingSlot(self.device, capacity, retired=self.slot)
        self.used = 0


class _StagingSlot:
    """A pinned host buffer, its device buffer, and the event of the copy that last read it."""

    def __init__(self, device: torch.device, capacity: int, retired: _StagingSlot | None = None) -> None:
        self.capacity = capacity
        self.host = torch.empty(capacity, dtype=torch.uint8, pin_memory=device.type == "cuda")
        self.host_bytes = self.host.numpy()
        self.device_buffer = torch.empty(capacity, dtype=torch.uint8, device=device)
        self.event: torch.cuda.Event | None = None
        self.retired = retired  # a smaller slot this one replaced: kept until its copy is done

    def wait(self) -> None:
        if self.event is not None:
            self.event.synchronize()
        self.retired = None

    def copy(self, used: int) -> None:
        self.device_buffer[:used].copy_(self.host[:used], non_blocking=True)
        if self.device_buffer.device.type == "cuda":  # (a CPU "device": the tests of this class)
            self.event = torch.cuda.Event()
            self.event.record()


_TORCH_DTYPES = {
    np.dtype(np.int64): torch.int64,
    np.dtype(np.int32): torch.int32,
    np.dtype(np.float32): torch.float32,
    np.dtype(np.bool_): torch.bool,
    np.dtype(np.uint8): torch.uint8,
}
