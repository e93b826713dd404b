"""An engine raises the collector's first threshold once it is built, unless told not to."""

from __future__ import annotations

import gc

import pytest

from weft.engine.heap import GEN0_THRESHOLD, settle_heap


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
