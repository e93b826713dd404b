"""The CPU kernels' build survives being killed (weft/native/__init__.py): a build killed mid-way
in a fresh cache directory leaves nothing that blocks or breaks the next process, which builds
the kernels again and loads them."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from weft.native import kernels_available

LOAD = "from weft.native import kernels_available; import sys; sys.exit(0 if kernels_available() else 3)"


@pytest.mark.slow
@pytest.mark.skipif(not kernels_available(), reason="no C++ compiler here: the kernels never build")
def test_a_build_killed_midway_is_redone_by_the_next_process(tmp_path: Path):
    env = {**os.environ, "WEFT_CACHE_DIR": str(tmp_path), "WEFT_NATIVE": "1"}
    first = subprocess.Popen(
        [sys.executable, "-c", LOAD], env=env, start_new_session=True, stderr=subprocess.PIPE
    )
    deadline = time.monotonic() + 120
    while not list(tmp_path.glob("kernels-*/build/build.ninja")):  # the compilers are running
        assert first.poll() is None and time.monotonic() < deadline, "the first build never started"
        time.sleep(0.2)
    time.sleep(2)
    os.killpg(first.pid, signal.SIGKILL)  # the process and its compilers, mid-build
    first.wait()
    (build,) = tmp_path.glob("kernels-*")
    assert not (build / "weft_kernels.so").exists()  # nothing half-built is ever in place
    second = subprocess.run(
        [sys.executable, "-c", LOAD], env=env, capture_output=True, text=True, timeout=900
    )
    assert second.returncode == 0, second.stderr
    assert "compiling CPU kernels" in second.stderr
    assert (build / "weft_kernels.so").is_file() and not (build / "build").exists()
