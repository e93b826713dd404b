"""benchmarks/linear_products.py runs every path it names, at a shape whose input features the
k-quant blocks divide and at one they do not (those paths then skipped, with a line saying so)."""

from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import require_native_kernels

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "linear_products.py"


@pytest.mark.parametrize(("shape", "paths"), [("256x64", 10), ("96x64", 8)])
def test_linear_products_prints_a_row_per_path(shape, paths):
    require_native_kernels()
    args = ["--shape", shape, "--rows", "1,3", "--repeats", "1", "--copies", "2"]
    command = [sys.executable, str(SCRIPT), *args]
    out = subprocess.run(command, capture_output=True, text=True, timeout=300, check=True)
    rows = [line for line in out.stdout.splitlines() if line.startswith("| ") and "GFLOP/s" not in line]
    assert len(rows) == paths, out.stdout
    for row in rows:  # two cells, each GFLOP/s and the GB/s read: "| name | 12 (3.4) | 20 (0.5) |"
        cells = [c.split() for c in row.strip("| ").split(" | ")[1:]]
        assert [len(c) for c in cells] == [2, 2], row
        # finite and not negative: a tiny matrix timed once while the suite's background jobs run
        # can print 0 (0.0), rounded, so zero is allowed
        numbers = [float(number.strip("()")) for cell in cells for number in cell]
        assert all(math.isfinite(n) and n >= 0 for n in numbers), row
    assert ("skipped" in out.stdout) == (shape == "96x64")
