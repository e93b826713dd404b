"""From how many rows a panel-packed `Linear` multiplies through torch's BLAS GEMM on a dense float32
copy of its weight instead of weft's panel kernel (`Linear.dense_rows`): measured once per machine
and matrix shape, then cached, so that the choice is the machine's and stays the same run to run.

The crossover depends on the CPU (vector width, AVX512_BF16 or AMX in oneDNN's kernels, cache
sizes), the thread count and the matrix's input size: on the 2-core AVX-512 machines of
docs/benchmarks.md MKL wins from about 1,000 rows, a CPU with AMX would move it far lower, and on
a 2-core AVX2 EPYC it wins from 128-256 rows (from 2-4 rows with an earlier AVX2 build of the panel
kernel that ran at ~5 GFLOP/s).

Steps, run by the loader before it reads the checkpoint (so that the measurement's memory never
adds to the weights'):
  1. `choose_dense_rows(shapes)`: for each distinct (in, out, dtype) shape of the model's linear
     layers, the lm_head aside (a prefill computes logits for a few rows only; it keeps the
     default), the cache (`dense-rows-v2.json` in weft's cache directory, keyed by the CPU's model
     name, the thread count, torch's version and the shape) answers, or a measurement does, in a
     child process (BLAS libraries keep their buffers once used, which would otherwise stay in the
     loading process beside the weights): random
     weights of that shape packed into panels, both paths at each of `CANDIDATE_ROWS` (random
     activations, best of 2, over at most `MAX_PROBE_COLUMNS` output columns: the time per column is
     the same for all); the threshold is the smallest candidate from which the dense GEMM is faster
     at every larger one, or `NEVER`;
  2. `apply_dense_rows(linears, chosen)`, once the weights are packed: every Linear takes its
     shape's threshold.
`WEFT_DENSE_ROWS=N` sets every threshold to N without measuring (a large N turns the GEMM off).
"""

from __future__ import annotations

import functools
import json
import platform
import subprocess
import sys
import time
import warnings
from collections.abc import Callable, Iterable
from pathlib import Path

import torch

from weft.config import NativeConfig
from weft.model.layers import DENSE_PANEL_ROWS, Linear, WeightLayout
from weft.native import build_dir

# A step holds 2,048 tokens by default. The small counts are there for kernels slower than the GEMM
# at few rows (an AVX2 build of the panel kernel once ran at ~5 GFLOP/s: the GEMM won from 2 rows);
# the cache is keyed by the kernels' build, so a changed kernel is measured again.
CANDIDATE_ROWS = (2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048)
MAX_PROBE_COLUMNS = 1024  # a multiple of the panel width (32)
NEVER = 1 << 62
CACHE_FILE = "dense-rows-v2.json"  # v2: measured from 2 rows (v1 began at 256)
CHILD = "import sys; from weft.model.prefill_gemm import _main; _main(sys.argv[1])"

Shape = tuple[int, int, torch.dtype]  # in_features, out_features, weight dtype
Measure = Callable[[Linear, int], tuple[float, float]]  # (linear, rows) -> (panel s, dense s)


def choose_dense_rows(
    shapes: Iterable[Shape],
    cache_dir: Path,
    fixed: int | None = None,
    measure: Measure | None = None,
    progress: bool = False,
) -> dict[Shape, int]:
    """The threshold of each shape: `fixed`, or from the cache, or measured (and cached)."""
    unique = list(dict.fromkeys(shapes))
    if fixed is not None:
        return dict.fromkeys(unique, fixed)
    cache_path = cache_dir / CACHE_FILE
    cache = _read_cache(cache_path)
    missing = [shape for shape in unique if _cache_key(shape) not in cache]
    if missing:
        if progress:
            names = ", ".join(f"{i}x{o}" for i, o, _ in missing)
            print(f"weft: measuring the prefill GEMM on this machine (once): {names}", file=sys.stderr)
        if measure is not None:
            found = {shape: crossover(probe_linear(shape), measure) for shape in missing}
        else:
            found = _measure_in_child(missing)
        if found:
            cache.update({_cache_key(shape): rows for shape, rows in found.items()})
            _write_cache(cache_path, cache)
    return {shape: cache.get(_cache_key(shape), DENSE_PANEL_ROWS) for shape in unique}


def _measure_in_child(shapes: list[Shape]) -> dict[Shape, int]:
    """`crossover` of each shape, measured by a child Python (`CHILD`) with this process's thread
    count; nothing (the defaults, not cached) if the child fails."""
    payload = json.dumps({"threads": torch.get_num_threads(), "shapes": [_shape_json(s) for s in shapes]})
    command = [sys.executable, "-c", CHILD, payload]
    try:
        result = subprocess.run(command, capture_output=True, text=True, timeout=600, check=True)
        rows = json.loads(result.stdout.strip().splitlines()[-1])
    except (subprocess.SubprocessError, OSError, ValueError, IndexError) as exc:
        warnings.warn(
            f"could not measure the prefill GEMM ({exc}); using {DENSE_PANEL_ROWS} rows", stacklevel=2
        )
        return {}
    return dict(zip(shapes, rows, strict=True))


def _shape_json(shape: Shape) -> list[object]:
    in_features, out_features, dtype = shape
    return [in_features, out_features, str(dtype).removeprefix("torch.")]


def _main(payload: str) -> None:
    """The child of `_measure_in_child`: prints the thresholds as one JSON list."""
    from weft.native import kernels_available

    request = json.loads(payload)
    torch.set_num_threads(request["threads"])
    if not kernels_available():
        raise SystemExit("weft's CPU kernels are not available")
    shapes = [(i, o, getattr(torch, d)) for i, o, d in request["shapes"]]
    print(json.dumps([crossover(probe_linear(shape), measure_paths) for shape in shapes]))


def apply_dense_rows(linears: Iterable[Linear], chosen: dict[Shape, int]) -> None:
    """Give every panel-packed Linear of `linears` its shape's threshold (by `linear_shape`)."""
    for lin in linears:
        if lin.layout is WeightLayout.PANELS and linear_shape(lin) in chosen:
            lin.dense_rows = chosen[linear_shape(lin)]


def linear_shape(linear: Linear) -> Shape:
    return linear.in_features, linear.out_features, linear.weight.dtype


def probe_linear(shape: Shape) -> Linear:
    """Random weights of `shape` packed into panels, at most `MAX_PROBE_COLUMNS` output columns."""
    in_features, out_features, dtype = shape
    probe = Linear(in_features, min(out_features, MAX_PROBE_COLUMNS))
    weight = torch.randn(probe.out_features, in_features, generator=torch.Generator().manual_seed(0))
    probe.weight = torch.nn.Parameter(weight.to(dtype), requires_grad=False)
    probe.set_layout(WeightLayout.PANELS)
    return probe


def crossover(linear: Linear, measure: Measure) -> int:
    """The smallest candidate row count from which the dense GEMM measured faster at every larger
    candidate too; NEVER if it is not faster at the largest."""
    dense_wins = [
        panel_s > dense_s for panel_s, dense_s in (measure(linear, rows) for rows in CANDIDATE_ROWS)
    ]
    threshold = NEVER
    for rows, wins in zip(reversed(CANDIDATE_ROWS), reversed(dense_wins), strict=True):
        if not wins:
            break
        threshold = rows
    return threshold


def measure_paths(linear: Linear, rows: int) -> tuple[float, float]:
    """Seconds of the panel kernel and of the dense copy plus GEMM for `rows` random rows, best of 2
    each."""
    x = torch.randn(rows, linear.in_features)
    panel = [_timed(lambda: linear.panel_forward(x)) for _ in range(2)]
    dense = [_timed(lambda: linear.dense_forward(x)) for _ in range(2)]
    return min(panel), min(dense)


def _timed(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def _cache_key(shape: Shape) -> str:
    in_features, out_features, dtype = shape
    where = f"{_cpu_name()}|threads={torch.get_num_threads()}|torch={torch.__version__}|{_kernels_build()}"
    return f"{where}|{in_features}x{out_features}|{dtype}"


@functools.cache
def _kernels_build() -> str:
    """The native kernels' build (a digest of their sources and flags): thresholds measured with
    other kernels do not apply."""
    return build_dir(NativeConfig.from_env()).name


@functools.cache
def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _read_cache(path: Path) -> dict[str, int]:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return {k: v for k, v in data.items() if isinstance(v, int)} if isinstance(data, dict) else {}


def _write_cache(path: Path, cache: dict[str, int]) -> None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(cache, indent=1, sort_keys=True))
        tmp.replace(path)
    except OSError:
        pass  # a read-only cache directory: measure again next time


__all__ = [
    "CANDIDATE_ROWS",
    "DENSE_PANEL_ROWS",
    "NEVER",
    "apply_dense_rows",
    "choose_dense_rows",
    "crossover",
    "linear_shape",
    "measure_paths",
]
