"""A GGUF file's header, read fast: its keys and values, and its tensors as views of the memory-mapped
file (nothing is copied).

The `gguf` package's `GGUFReader` keeps a numpy view of every part of every field, several per
string: for a tokenizer of 50k tokens and merges that is millions of views and seconds of work per
load. This reader decodes each value once, with `struct` over the mapped bytes (tens of
milliseconds), and gives what weft reads: `fields[key].contents()` and `.types` as GGUFReader has
them, and `tensors` with `name`, `shape` (GGUF's order, fastest dimension first), `tensor_type`
and `data` (`GGUFReader`'s layout: float types as their numpy dtype in numpy order, the others as
rows of bytes). The format: https://github.com/ggml-org/ggml/blob/master/docs/gguf.md
(little-endian files, version 2 and 3).

The mapping is copy-on-write (nothing writes to it; its views are writable numpy arrays, as torch
wants them) and shares its pages with the page cache. Once a loader has read a tensor (packed it,
dequantized it), `release_pages` drops that tensor's pages from the process's resident memory: they
stay in the page cache, and a later read maps them again. A file as large as most of the machine
then never sits in a process's resident memory beside what was made of it.
"""

from __future__ import annotations

import mmap
import struct
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

MAGIC = b"GGUF"
_ALIGNMENT = 32  # the default of general.alignment
# GGUF value types: struct format of each scalar type; 8 is a string, 9 an array
_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_STRING, _ARRAY = 8, 9
_LENGTH = struct.Struct("<Q")  # a string's byte count
# GGML types whose data is read as numbers rather than bytes (as GGUFReader reads them)
_NUMPY_TYPES = {"F32": np.float32, "F16": np.float16, "F64": np.float64, "I8": np.int8, "I16": np.int16}
_NUMPY_TYPES |= {"I32": np.int32, "I64": np.int64}


@dataclass(frozen=True)
class GgufField:
    """One key's value: `types` is [its type] or [ARRAY, the element type] (gguf.GGUFValueType)."""

    types: list[Any]
    value: Any

    def contents(self) -> Any:
        return self.value


@dataclass(frozen=True)
class GgufTensor:
    name: str
    shape: tuple[int, ...]  # GGUF's order: the fastest-varying dimension first
    tensor_type: Any  # gguf.GGMLQuantizationType
    data: np.ndarray  # a view of the mapped file (see the module's docstring)


class _Cursor:
    """Little-endian reads at a moving offset of a buffer."""

    def __init__(self, buffer: memoryview) -> None:
        self.buffer, self.offset = buffer, 0

    def scalar(self, fmt: str) -> Any:
        (value,) = struct.unpack_from("<" + fmt, self.buffer, self.offset)
        self.offset += struct.calcsize(fmt)
        return value

    def string(self) -> str:
        length = self.scalar("Q")
        end = self.offset + length
        if end > len(self.buffer):
            raise ValueError(f"a string of {length} bytes runs past the end of the file")
        text = str(self.buffer[self.offset : end], "utf-8")
        self.offset = end
        return text

    def value(self, kind: int) -> Any:
        if kind == _STRING:
            return self.string()
        if kind not in _SCALARS:
            raise ValueError(f"unknown value type {kind}")
        return self.scalar(_SCALARS[kind])

    def array(self, kind: int) -> list[Any]:
        count = self.scalar("Q")
        if kind in _SCALARS and kind != 7:  # numbers: one numpy read
            dtype = np.dtype("<" + _SCALARS[kind])
            values = np.frombuffer(self.buffer, dtype, count, self.offset)
            self.offset += count * dtype.itemsize
            return values.tolist()
        if kind == _STRING:
            return self.strings(count)
        return [self.value(kind) for _ in range(count)]

    def strings(self, count: int) -> list[str]:
        """`count` strings in a row (a tokenizer's tokens and merges: 100k or more), in one loop
        with its lookups hoisted: 4x faster than `string` per element."""
        buffer, offset, size = self.buffer, self.offset, len(self.buffer)
        unpack = _LENGTH.unpack_from
        out: list[str] = []
        append = out.append
        for _ in range(count):
            (length,) = unpack(buffer, offset)
            offset += 8
            if offset + length > size:
                raise ValueError(f"a string of {length} bytes runs past the end of the file")
            append(str(buffer[offset : offset + length], "utf-8"))
            offset += length
        self.offset = offset
        return out


class GgufFile:
    """The header of the GGUF file at `path`; `ValueError` (or `struct.error`) where it is not one."""

    def __init__(self, path: Path) -> None:
        from gguf import GGUFValueType

        with open(path, "rb") as file:
            self._map = mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_COPY)  # ValueError if empty
        self.mapping = np.frombuffer(self._map, dtype=np.uint8)
        _OPEN.add(self)
        cursor = _Cursor(self.mapping.data)  # memoryview of the mapped bytes
        if bytes(cursor.buffer[:4]) != MAGIC:
            raise ValueError("the file does not start with GGUF's magic bytes")
        cursor.offset = 4
        version = cursor.scalar("I")
        if version not in (2, 3):
            raise ValueError(f"GGUF version {version} (weft reads versions 2 and 3, little-endian)")
        num_tensors, num_fields = cursor.scalar("Q"), cursor.scalar("Q")
        self.fields: dict[str, GgufField] = {}
        for _ in range(num_fields):
            key, kind = cursor.string(), cursor.scalar("I")
            if kind == _ARRAY:
                element = cursor.scalar("I")
                types = [GGUFValueType(kind), GGUFValueType(element)]
                self.fields[key] = GgufField(types, cursor.array(element))
            else:
                self.fields[key] = GgufField([GGUFValueType(kind)], cursor.value(kind))
        infos = [self._tensor_info(cursor) for _ in range(num_tensors)]
        alignment = self.fields.get("general.alignment", GgufField([], _ALIGNMENT)).value
        start = -(-cursor.offset // alignment) * alignment
        self.tensors = [self._tensor(start, *info) for info in infos]

    @staticmethod
    def _tensor_info(cursor: _Cursor) -> tuple[str, tuple[int, ...], int, int]:
        name = cursor.string()
        shape = tuple(cursor.scalar("Q") for _ in range(cursor.scalar("I")))
        return name, shape, cursor.scalar("I"), cursor.scalar("Q")

    def _tensor(self, start: int, name: str, shape: tuple[int, ...], kind: int, offset: int) -> GgufTensor:
        from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

        tensor_type = GGMLQuantizationType(kind)
        block, block_bytes = GGML_QUANT_SIZES[tensor_type]
        dims = tuple(reversed(shape))  # numpy order
        count = int(np.prod(shape))
        begin = start + offset
        if tensor_type.name in _NUMPY_TYPES:
            dtype = np.dtype(_NUMPY_TYPES[tensor_type.name]).newbyteorder("<")
            data = np.frombuffer(self.mapping, dtype, count, begin).reshape(dims)
        else:  # rows of blocks, as bytes
            if dims[-1] % block:
                raise ValueError(f"tensor {name!r}: rows of {dims[-1]} values are not whole {block}-blocks")
            row_bytes = dims[-1] // block * block_bytes
            data = np.frombuffer(self.mapping, np.uint8, count // block * block_bytes, begin)
            data = data.reshape(*dims[:-1], row_bytes)
        return GgufTensor(name, shape, tensor_type, data)

    def release(self, address: int, nbytes: int) -> bool:
        """Drop the whole pages of [address, address + nbytes) from resident memory, where that
        range lies in this file's mapping; whether it does."""
        base = self.mapping.ctypes.data
        start, end = address - base, address - base + nbytes
        if start < 0 or end > self.mapping.size:
            return False
        start, end = -(-start // mmap.PAGESIZE) * mmap.PAGESIZE, end // mmap.PAGESIZE * mmap.PAGESIZE
        if end > start:
            self._map.madvise(mmap.MADV_DONTNEED, start, end - start)
        return True


_OPEN: weakref.WeakSet[GgufFile] = weakref.WeakSet()  # the files mapped now


def release_pages(address: int, nbytes: int) -> None:
    """Drop the pages of a view of an open GGUF file's mapping that has been read (see the module's
    docstring); nothing where the range is not in one (a copy, another source's tensor)."""
    for file in list(_OPEN):
        if file.release(address, nbytes):
            return


__all__ = ["MAGIC", "GgufField", "GgufFile", "GgufTensor", "release_pages"]
