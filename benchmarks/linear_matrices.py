"""Every matrix of a loaded model timed alone at one step size: milliseconds and GFLOP/s per kind of
matrix (its name, its quantized panels, its shape), best of 3 calls after one untimed, the
lm_head left out. What a prefill of `--rows` tokens spends in each kind of product.

    python benchmarks/linear_matrices.py FILE.gguf --rows 128
"""

from __future__ import annotations

import argparse
import collections
import time

import torch

from weft import LLM
from weft.model.layers import Linear


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("model")
    p.add_argument("--rows", type=int, default=128, help="rows of x (tokens of a step)")
    args = p.parse_args()
    model = LLM(args.model, max_model_len=1024, show_progress=False).engine.model
    totals: dict[tuple, list[float]] = collections.defaultdict(lambda: [0.0, 0.0, 0])
    for name, module in model.named_modules():
        if not isinstance(module, Linear) or "lm_head" in name:
            continue
        x = torch.randn(args.rows, module.in_features)  # [rows, in]
        module(x)
        best = min(_seconds(module, x) for _ in range(3))
        key = (name.rsplit(".", 1)[-1], module.quantized, module.out_features, module.in_features)
        total = totals[key]
        total[0] += best
        total[1] += 2 * args.rows * module.in_features * module.out_features
        total[2] += 1
    print(f"threads {torch.get_num_threads()}, {args.rows} rows")
    print("| matrix | panels | out x in | count | ms | GFLOP/s |\n|---|---|---|---:|---:|---:|")
    for (name, kind, n, k), (seconds, flops, count) in sorted(totals.items(), key=lambda kv: -kv[1][0]):
        gflops = flops / seconds / 1e9
        print(f"| {name} | {kind} | {n} x {k} | {count} | {seconds * 1e3:.1f} | {gflops:.0f} |")
    print(f"all: {sum(t[0] for t in totals.values()) * 1e3:.1f} ms")


def _seconds(module: Linear, x: torch.Tensor) -> float:
    start = time.perf_counter()
    module(x)
    return time.perf_counter() - start


if __name__ == "__main__":
    main()
