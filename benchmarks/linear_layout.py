"""Which weight layout streams fastest through a decode-step matmul on this machine.

    python benchmarks/linear_layout.py [--rows 1,8,32]

For each dtype and number of rows (the batch of a decode step), times the ways to multiply the rows
by the weight matrices of SmolLM2-135M's shapes (q/k/v fused, o, gate/up fused, down, lm_head),
cycling through enough distinct matrices to defeat the CPU caches. The methods alternate three
times and each keeps its best round, so that load from other tenants hits them alike. Prints the
achieved weight-read bandwidth next to a plain memory read.
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

from weft.bench.throughput import read_bandwidth_gbs

SHAPES = [(576, 960), (576, 576), (576, 3072), (1536, 576), (576, 49152)]  # (in, out)
METHODS = {
    "x @ W [in,out]": lambda x, w_io, w_oi: x @ w_io,
    "F.linear [out,in]": lambda x, w_io, w_oi: F.linear(x, w_oi),
    "torch.mv [out,in]": lambda x, w_io, w_oi: torch.mv(w_oi, x[0]),
}


def make_weights(dtype: torch.dtype) -> list[tuple[list[torch.Tensor], list[torch.Tensor]]]:
    """Per shape: enough distinct [in, out] matrices for ~300 MB, and their [out, in] copies."""
    weights = []
    for fan_in, fan_out in SHAPES:
        count = max(2, int(300e6 // (fan_in * fan_out * 4)))
        w_io = [torch.randn(fan_in, fan_out).to(dtype) for _ in range(count)]
        weights.append((w_io, [w.t().contiguous() for w in w_io]))
    return weights


def bandwidth(method, weights, rows: int) -> float:
    num_bytes, seconds = 0, 0.0
    for w_io, w_oi in weights:
        x = torch.randn(rows, w_io[0].shape[0]).to(w_io[0].dtype)
        method(x, w_io[0], w_oi[0])  # warm-up
        start = time.perf_counter()
        for a, b in zip(w_io, w_oi, strict=True):
            method(x, a, b)
        seconds += time.perf_counter() - start
        num_bytes += sum(w.numel() * w.element_size() for w in w_io)
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
            weights = make_weights(dtype)
            for rows in row_counts:
                methods = {n: m for n, m in METHODS.items() if rows == 1 or "mv" not in n}
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
