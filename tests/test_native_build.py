"""The CPU kernels' build survives being killed (weft/native/__init__.py): a build killed mid-way
in a fresh cache directory leaves nothing that blocks or breaks the next process, which builds
the kernels again and loads them (tests/killed_build.py, run in the background from collection)."""

from __future__ import annotations

import sys

import background
import pytest

from weft.native import kernels_available

JOB = "killed-build"


def command() -> list[str]:
    return [sys.executable, "tests/killed_build.py", str(background.scratch(JOB))]


@pytest.mark.slow
@pytest.mark.background
def test_a_build_killed_midway_is_redone_by_the_next_process():
    if not kernels_available():
        pytest.skip("no C++ compiler here: the kernels never build")
    if not background.started(JOB):  # a run that did not go through the collection hook
        background.start(JOB, command())
    code, output = background.finish(JOB)
    assert code == 0, output[-6000:]
