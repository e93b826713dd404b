"""An engine raises the collector's first threshold once it is built, and on CPU keeps freed C heap
memory for the next step, unless told not to."""

from __future__ import annotations

import ctypes
import gc
import platform

import pytest
import torch

from weft.engine.heap import GEN0_THRESHOLD, keep_freed_memory, settle_heap


@pytest.fixture
def thresholds():
    saved = gc.get_threshold()
    gc.set_threshold(700, 10, 10)
    yield
    gc.set_threshold(*saved)


def test_settle_heap_raises_the_first_threshold(thresholds, monkeypatch):
    monkeypatch.delenv("WEFT_GC_TUNING", raising=False)
    settle_heap()
    assert gc.get_threshold() == (GEN0_THRESHOLD, 10, 10)


def test_settle_heap_keeps_a_higher_or_disabled_setting(thresholds, monkeypatch):
    gc.set_threshold(50_000, 10, 10)
    settle_heap()
    assert gc.get_threshold()[0] == 50_000
    gc.set_threshold(0, 10, 10)  # collection off: left off
    settle_heap()
    assert gc.get_threshold()[0] == 0


def test_settle_heap_can_be_turned_off(thresholds, monkeypatch):
    monkeypatch.setenv("WEFT_GC_TUNING", "0")
    settle_heap()
    assert gc.get_threshold() == (700, 10, 10)


def test_building_an_engine_settles_the_heap(thresholds, tiny_llama, monkeypatch):
    from weft import LLM

    monkeypatch.delenv("WEFT_GC_TUNING", raising=False)
    LLM(str(tiny_llama), show_progress=False, device="cpu", dtype="float32")
    assert gc.get_threshold()[0] == GEN0_THRESHOLD


class _MallInfo2(ctypes.Structure):
    _fields_ = [  # glibc's struct mallinfo2, every field a size_t
        (name, ctypes.c_size_t)
        for name in (
            "arena",
            "ordblks",
            "smblks",
            "hblks",
            "hblkhd",
            "usmblks",
            "fsmblks",
            "uordblks",
            "fordblks",
            "keepcost",
        )
    ]


def _malloc_stats() -> _MallInfo2:
    mallinfo2 = ctypes.CDLL(None).mallinfo2
    mallinfo2.restype = _MallInfo2
    return mallinfo2()


@pytest.mark.skipif(
    platform.libc_ver()[0] != "glibc" or not hasattr(ctypes.CDLL(None), "mallinfo2"),
    reason="malloc tuning is glibc's (mallopt), and the test reads glibc 2.33's mallinfo2",
)
def test_freed_activations_stay_in_the_heap_for_the_next_step(monkeypatch):
    """A 48 MB activation (above the 32 MB glibc's own threshold reaches: by default a fresh mapping,
    page-faulted in, every step) comes from the heap, and its memory stays there once freed."""
    monkeypatch.delenv("WEFT_MALLOC_TUNING", raising=False)
    assert keep_freed_memory()
    x = torch.empty(12 << 20)  # 48 MB of float32
    during = _malloc_stats()
    del x
    after = _malloc_stats()
    assert during.hblkhd < 48 << 20  # not mapped on its own
    assert after.fordblks >= 48 << 20  # kept, free, for the next step


def test_malloc_tuning_can_be_turned_off(monkeypatch):
    monkeypatch.setenv("WEFT_MALLOC_TUNING", "0")
    assert not keep_freed_memory()
