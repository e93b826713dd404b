"""A build of the CPU kernels killed mid-way, then the next process: `python tests/killed_build.py
CACHE_DIR` exits 0 when the next process builds the kernels again and loads them, and nothing
half-built was ever in place. The suite runs it in the background (tests/background.py), and
`test_native_build.test_a_build_killed_midway_is_redone_by_the_next_process` awaits it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

LOAD = "from weft.native import kernels_available; import sys; sys.exit(0 if kernels_available() else 3)"


def check(cache: Path) -> None:
    # -O0: the build machinery is what is tested, and it compiles in 60% of the CPU time of -O3
    env = {**os.environ, "WEFT_CACHE_DIR": str(cache), "WEFT_NATIVE": "1", "WEFT_NATIVE_CFLAGS": "-O0"}
    first = subprocess.Popen([sys.executable, "-c", LOAD], env=env, start_new_session=True)
    deadline = time.monotonic() + 600
    while not list(cache.glob("kernels-*/build/build.ninja")):  # the compilers are running
        assert first.poll() is None and time.monotonic() < deadline, "the first build never started"
        time.sleep(0.2)
    time.sleep(2)
    os.killpg(first.pid, signal.SIGKILL)  # the process and its compilers, mid-build
    first.wait()
    (build,) = cache.glob("kernels-*")
    assert not (build / "weft_kernels.so").exists(), "a half-built library was put in place"
    load = [sys.executable, "-c", LOAD]
    second = subprocess.run(load, env=env, capture_output=True, text=True, timeout=1200)
    assert second.returncode == 0, second.stderr[-3000:]
    assert "compiling CPU kernels" in second.stderr, second.stderr[-3000:]
    assert (build / "weft_kernels.so").is_file() and not (build / "build").exists()
    print("a killed build was redone by the next process")


if __name__ == "__main__":
    sys.path.insert(1, str(Path(__file__).resolve().parents[1]))  # weft from this checkout
    check(Path(sys.argv[1]))
