"""Host arrays for the step: small per-row values gathered on the host with numpy (building a
torch tensor from a Python list costs several times more) and moved to the device once each."""

from __future__ import annotations

import itertools
from collections.abc import Sequence

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
