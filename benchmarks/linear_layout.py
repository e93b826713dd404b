"""Which weight layout streams fastest through a single-row matmul (batch-1 decode) on this machine.

    python benchmarks/linear_layout.py

For each dtype, times four ways to multiply one row by the weight matrices of SmolLM2-135M's shapes
(q/k/v fused, o, gate/up fused, down, lm_head), cycling through enough distinct matrices to defeat
the CPU caches, and prints the achieved weight-read bandwidth next to a plain memory read.
"""

from __future__ import annotations

import time

import torch
import torch.nn.functional as F

SHAPES = [(576, 960), (576, 576), (576, 3072), (1536, 576), (576, 49152)]  # (in, out)
METHODS = {
    "x @ W [in,out]": lambda x, w_io, w_oi: x @ w_io,
    "F.linear [out,in]": lambda x, w_io, w_oi: F.linear(x, w_oi),
    "torch.mv [out,in]": lambda x, w_io, w_oi: torch.mv(w_oi, x[0]),
}


def bandwidth(method, dtype: torch.dtype) -> float:
    num_bytes, seconds = 0, 0.0
    for fan_in, fan_out in SHAPES:
        count = max(2, int(300e6 // (fan_in * fan_out * 4)))
        w_io = [torch.randn(fan_in, fan_out).to(dtype) for _ in range(count)]
        w_oi = [w.t().contiguous() for w in w_io]
        x = torch.randn(1, fan_in).to(dtype)
        for a, b in zip(w_io[:2], w_oi[:2], strict=True):
            method(x, a, b)
        start = time.perf_counter()
        for _ in range(3):
            for a, b in zip(w_io, w_oi, strict=True):
                method(x, a, b)
        seconds += time.perf_counter() - start
        num_bytes += 3 * count * fan_in * fan_out * w_io[0].element_size()
    return num_bytes / seconds / 1e9


def main() -> None:
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    data = torch.ones(128 * 1024 * 1024)
    read = []
    for _ in range(5):
        start = time.perf_counter()
        data.sum()
        read.append(time.perf_counter() - start)
    print(f"plain memory read: {data.numel() * 4 / min(read) / 1e9:.1f} GB/s\n")
    print("| dtype | " + " | ".join(METHODS) + " |")
    print("|---|" + "---:|" * len(METHODS))
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        cells = [f"{bandwidth(m, dtype):.1f} GB/s" for m in METHODS.values()]
        print(f"| {str(dtype).removeprefix('torch.')} | " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()
