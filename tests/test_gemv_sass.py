"""benchmarks/gemv_sass.py compiles the decode kernels over GGUF blocks for sm_90 with Triton's own
compiler and ptxas (no GPU) and counts their SASS: the int8 kernel's `dp4a` loop spends fewer
instructions a Q4_K weight than the float products do (16 columns, one warp: a thread's 128 weights
a chunk are 16 words, two `dp4a` each)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "gemv_sass.py"


def test_the_int8_loop_costs_fewer_instructions_a_weight():
    nvidia = pytest.importorskip("triton.backends.nvidia")
    if not (Path(nvidia.__file__).parent / "bin" / "ptxas").is_file():
        pytest.skip("Triton's wheel here has no ptxas")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # compiled, not interpreted
    command = [sys.executable, str(SCRIPT), "--kinds", "q4_k", "--tiles", "16x1"]
    out = subprocess.run(command, capture_output=True, text=True, timeout=300, check=True, env=env).stdout
    rows = {}
    for line in out.splitlines():
        cells = [c.strip() for c in line.strip("|").split("|")]
        if cells[0] in ("float", "int8"):
            rows[cells[0]] = (int(cells[3]), int(cells[4]), float(cells[5]), int(cells[6]))
    assert set(rows) == {"float", "int8"}, out
    assert rows["int8"][2] < 0.7 * rows["float"][2], rows  # measured 3.73 against 6.17
    assert rows["int8"][3] == 32 and rows["float"][3] == 0, rows  # two dp4a a word of 8 weights
    assert all(0 < regs <= 255 and loop > 0 for regs, loop, _, _ in rows.values()), rows
