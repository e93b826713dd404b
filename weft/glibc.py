"""The C library where it is glibc: the malloc controls that weft's memory placement uses
(`malloc_trim` at load, weft/model/huge_pages.py; `mallopt` once an engine is built,
weft/engine/heap.py). None elsewhere (musl, macOS, Windows), where both leave malloc alone."""

from __future__ import annotations

import ctypes
import functools


@functools.cache
def glibc() -> ctypes.CDLL | None:
    try:
        libc = ctypes.CDLL(None)
        libc.malloc_trim  # noqa: B018 (glibc's own: other C libraries may have a mallopt, not this)
        libc.mallopt  # noqa: B018
    except (OSError, AttributeError):
        return None
    return libc
