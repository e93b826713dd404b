"""Which weight layout streams fastest through a decode-step matmul on this machine.

    python benchmarks/linear_layout.py [--rows 1,8,32]

For each dtype and number of rows (the batch of a decode step), times the ways to multiply the rows
by the weight matrices of SmolLM2-135M's shapes (q/k/v fused, o, gate/up fused, down, lm_head),
weft's panel kernel among them (when the CPU kernels are built; float32 activations, the weights in
the row's dtype), cycling through enough distinct matrices to defeat the CPU caches. The methods
alternate three times and each keeps its best round, so that load from other tenants hits them
alike. Prints the achieved weight-read bandwidth next to a plain memory read.
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

from weft.bench.throughput import read_bandwidth_gbs
from weft.native import kernels_available

SHAPES = [(576, 960), (576, 576), (576, 3072), (1536, 576), (576, 49152)]  # (in, out)
Weights = dict[str, torch.Tensor]  # one matrix in each layout: "io" [in, out], "oi" [out, in], "panels"
METHODS = {
    "x @ W [in,out]": lambda x, w: x @ w["io"],
    "F.linear [out,in]": lambda x, w: F.linear(x, w["oi"]),
    "torch.mv [out,in]": lambda x, w: torch.mv(w["oi"], x[0]),
    # float32 activations whatever the weights' dtype (they are widened in registers)
    "weft panels": lambda x, w: torch.ops.weft.packed_linear(x.float(), w["panels"], None, w["oi"].shape[0]),
}


def make_weights(dtype: torch.dtype, panels: bool) -> list[list[Weights]]:
    """Per shape: enough distinct matrices for ~300 MB, each in every layout."""
    weights = []
    for fan_in, fan_out in SHAPES:
        count = max(2, int(300e6 // (fan_in * fan_out * 4)))
        matrices = []
        for _ in range(count):
            w_oi = torch.randn(fan_out, fan_in).to(dtype)
            w = {"oi": w_oi, "io": w_oi.t().contiguous()}
            if panels:
                w["panels"] = torch.ops.weft.pack_linear_weight(w_oi)
            matrices.append(w)
        weights.append(matrices)
    return weights


def bandwidth(method, weights: list[list[Weights]], rows: int) -> float:
    num_bytes, seconds = 0, 0.0
    for matrices in weights:
        x = torch.randn(rows, matrices[0]["io"].shape[0]).to(matrices[0]["io"].dtype)
        method(x, matrices[0])  # warm-up
        start = time.perf_counter()
        for w in matrices:
            method(x, w)
        seconds += time.perf_counter() - start
        num_bytes += sum(w["io"].numel() * w["io"].element_size() for w in matrices)
    return num_bytes / seconds / 1e9


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rows", default="1,8,32", help="comma-separated rows per matmul (default: 1,8,32)")
    row_counts = [int(r) for r in parser.parse_args().rows.split(",")]
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    print(f"plain memory read: {read_bandwidth_gbs():.1f} GB/s\n")
    print("| dtype | rows | " + " | ".join(METHODS) + " |")
    print("|---|---:|" + "---:|" * len(METHODS))
    with torch.inference_mode():
        for dtype in (torch.float32, torch.bfloat16, torch.float16):
            panels = kernels_available()
            weights = make_weights(dtype, panels)
            for rows in row_counts:
                methods = {
                    n: m
                    for n, m in METHODS.items()
                    if (rows == 1 or "mv" not in n) and (panels or "panels" not in n)
                }
                best = dict.fromkeys(methods, 0.0)
                for _ in range(3):
                    for name, method in methods.items():
                        best[name] = max(best[name], bandwidth(method, weights, rows))
                cells = [f"{best[n]:.1f} GB/s" if n in best else "-" for n in METHODS]
                print(
                    f"| {str(dtype).removeprefix('torch.')} | {rows} | " + " | ".join(cells) + " |",
                    flush=True,
                )


if __name__ == "__main__":
    main()
