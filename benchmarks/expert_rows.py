"""gpt-oss's routed experts at batch 1: MXFP4 dot panels against the same weights as Q5_0's.

    python benchmarks/expert_rows.py [--experts 32] [--steps 200] [--rounds 4]

One decode step's expert products of a gpt-oss-20b layer (`torch.ops.weft.packed_linear_rows`: the
row against each of its 4 routed experts' gate|up [5760, 2880], then down [2880, 2880]) over
random MXFP4 blocks, with each step routed to other experts of `--experts` so that the weights
come from memory, not the caches. The two layouts hold exactly the same weights: MXFP4's own dot
panels (4.25 bits a weight, as in the file) and the Q5_0 panels the blocks are rewritten into for
exact products (5.5 bits). They alternate round by round; prints each round's time and read
rate, the plain memory read, and the ratio of the best rounds.
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch

from weft.bench.random_gguf import random_mxfp4
from weft.bench.throughput import read_bandwidth_gbs
from weft.model.quantized import QuantizedRows
from weft.native import kernels_available

HIDDEN, INTERMEDIATE, ROUTED = 2880, 2880, 4  # gpt-oss-20b
Panels = tuple[list[torch.Tensor], list[torch.Tensor]]  # every expert's gate|up, and its down


def make_panels(experts: int) -> dict[str, Panels]:
    rng = np.random.default_rng(0)
    gate_up = [
        QuantizedRows("mxfp4", torch.from_numpy(random_mxfp4(2 * INTERMEDIATE, HIDDEN, rng)))
        for _ in range(experts)
    ]
    down = [
        QuantizedRows("mxfp4", torch.from_numpy(random_mxfp4(HIDDEN, INTERMEDIATE, rng)))
        for _ in range(experts)
    ]
    return {
        "mxfp4": ([m.pack(dot=True) for m in gate_up], [m.pack(dot=True) for m in down]),
        "q5_0": (
            [m.rewritten().pack(dot=True) for m in gate_up],
            [m.rewritten().pack(dot=True) for m in down],
        ),
    }


def run(panels: Panels, x: torch.Tensor, steps: int) -> float:
    """Seconds a step: each step's row against 4 experts none of the last steps used."""
    gate_up, down = panels
    start = time.perf_counter()
    for step in range(steps):
        ids = [(ROUTED * step + 7 * j) % len(gate_up) for j in range(ROUTED)]
        torch.ops.weft.packed_linear_rows(x, [gate_up[i] for i in ids], 2 * INTERMEDIATE)
        torch.ops.weft.packed_linear_rows(x[:, :INTERMEDIATE], [down[i] for i in ids], HIDDEN)
    return (time.perf_counter() - start) / steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--experts", type=int, default=32)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=4)
    args = parser.parse_args()
    if not kernels_available():
        raise SystemExit("weft's CPU kernels are not built here: nothing to measure")
    panels = make_panels(args.experts)
    x = torch.randn(ROUTED, HIDDEN)  # the row, once per routed expert
    best: dict[str, float] = {}
    for round_ in range(args.rounds):
        for name, layout in panels.items():
            seconds = run(layout, x, args.steps)
            step_bytes = ROUTED * (layout[0][0].numel() + layout[1][0].numel())
            best[name] = min(best.get(name, seconds), seconds)
            rate = step_bytes / seconds / 1e9
            print(f"round {round_ + 1} {name}: {seconds * 1e3:.3f} ms a step, {rate:.1f} GB/s")
    print(
        f"plain read {read_bandwidth_gbs(torch.device('cpu')):.1f} GB/s; "
        f"MXFP4 panels {best['q5_0'] / best['mxfp4']:.2f}x the Q5_0 ones"
    )


if __name__ == "__main__":
    main()
