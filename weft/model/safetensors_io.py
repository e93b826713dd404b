"""Read a safetensors file tensor by tensor into ordinary memory, without mapping the file.

The safetensors package maps the whole file and hands out tensors over the mapping: every page a
tensor touches stays resident (and counted in the process's memory) for as long as any tensor of
the file lives, on top of the packed copies the loader makes. Reading each tensor's bytes into a
fresh buffer instead lets the loader free a tensor as soon as it has converted it, so loading a
bfloat16 checkpoint peaks at about the checkpoint's size (docs/architecture.md).

Format: an 8-byte little-endian header length, a JSON header mapping each name to its dtype, shape
and [begin, end) byte offsets in the data that follows, and the data.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}
MAX_HEADER_BYTES = 100 * 1024 * 1024  # the format's own limit


class SafetensorsError(ValueError):
    """A file that is not valid safetensors; the message says what is wrong (not which file)."""


def read_header(path: Path) -> tuple[dict[str, dict[str, Any]], int]:
    """The header's tensor entries by name, and the byte offset where the data starts."""
    with path.open("rb") as f:
        prefix = f.read(8)
        if len(prefix) != 8:
            raise SafetensorsError("shorter than a safetensors header")
        (length,) = struct.unpack("<Q", prefix)
        if length > MAX_HEADER_BYTES:
            raise SafetensorsError(f"header length {length} is past the format's limit")
        try:
            header = json.loads(f.read(length))
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise SafetensorsError(f"the header is not JSON ({exc})") from None
    if not isinstance(header, dict):
        raise SafetensorsError("the header is not a JSON object")
    header.pop("__metadata__", None)
    return header, 8 + length


def read_tensors(path: Path) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) for every tensor of the file, in file order, each in its own new buffer."""
    header, data_start = read_header(path)
    size = path.stat().st_size
    entries = sorted(header.items(), key=lambda item: _offsets(item[0], item[1])[0])
    with path.open("rb", buffering=0) as f:
        for name, entry in entries:
            dtype, shape, (begin, end) = _dtype(name, entry), _shape(name, entry), _offsets(name, entry)
            tensor = torch.empty(shape, dtype=dtype)
            if end - begin != tensor.numel() * tensor.element_size() or data_start + end > size:
                raise SafetensorsError(f"tensor {name!r}: its byte range does not match its dtype and shape")
            f.seek(data_start + begin)
            raw = tensor.view(-1).view(torch.uint8).numpy()  # the tensor's bytes, no copy
            if f.readinto(raw) != raw.nbytes:  # type: ignore[arg-type]
                raise SafetensorsError(f"tensor {name!r}: the file ends inside its data")
            yield name, tensor


def _dtype(name: str, entry: dict[str, Any]) -> torch.dtype:
    dtype = DTYPES.get(entry.get("dtype", ""))
    if dtype is None:
        raise SafetensorsError(f"tensor {name!r}: dtype {entry.get('dtype')!r} is not supported")
    return dtype


def _shape(name: str, entry: dict[str, Any]) -> list[int]:
    shape = entry.get("shape")
    if not isinstance(shape, list) or not all(isinstance(d, int) and d >= 0 for d in shape):
        raise SafetensorsError(f"tensor {name!r}: shape {shape!r} is not a list of sizes")
    return shape


def _offsets(name: str, entry: Any) -> tuple[int, int]:
    offsets = entry.get("data_offsets") if isinstance(entry, dict) else None
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(isinstance(o, int) for o in offsets)):
        raise SafetensorsError(f"tensor {name!r}: no valid data_offsets")
    begin, end = offsets
    if not 0 <= begin <= end:
        raise SafetensorsError(f"tensor {name!r}: data_offsets {offsets} are out of order")
    return begin, end
