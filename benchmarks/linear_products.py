"""GFLOP/s of one matrix product in each of weft's CPU paths, at decode- and prefill-sized row counts.

    python benchmarks/linear_products.py [--shape 576x3072] [--rows 1,8,32,128,1024,4096]

Paths: bfloat16 weights with float32 products (widened in registers) and with bfloat16 products
(vdpbf16ps, or its emulation where the CPU lacks AVX512_BF16), Q8_0 weights (GGUF blocks, widened
with their scales), the int8-activation products of GGUF blocks (qdot.cpp: Q8_0, Q4_K quantized
from the same weights, Q6_K of random blocks: its speed does not depend on the values), float32
weights, and oneDNN's bfloat16 GEMM (`torch.mm` on bfloat16 tensors, bfloat16 output) for
reference. Each is timed best of --repeats on the same random weights; the ISA path of weft's
kernels is printed first. --paths picks some (substrings of the names).
"""

from __future__ import annotations

import argparse
import functools
import time
from collections.abc import Callable

import numpy as np
import torch

from weft.kernels import cpu_isa_path
from weft.native import kernels_available


def best_seconds(fn: Callable[[], object], repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def q8_0_rows(
    weight: torch.Tensor,
) -> torch.Tensor:  # float32 [N, K] -> GGUF Q8_0 rows uint8 [N, K / 32 * 34]
    blocks = weight.view(weight.shape[0], -1, 32)
    scales = blocks.abs().amax(-1, keepdim=True) / 127
    quants = torch.round(blocks / torch.where(scales == 0, 1, scales)).to(torch.int8)
    raw = np.concatenate([scales.half().numpy().view(np.uint8), quants.numpy().view(np.uint8)], axis=2)
    return torch.from_numpy(raw.reshape(weight.shape[0], -1).copy())


def random_q6_k_rows(n: int, k: int) -> torch.Tensor:  # GGUF Q6_K rows uint8 [N, K / 256 * 210]
    blocks = np.random.default_rng(0).integers(0, 256, (n, k // 256, 210), dtype=np.uint8)
    blocks[:, :, 208:] = np.array([0.01], dtype=np.float16).view(np.uint8)  # d: finite outputs
    return torch.from_numpy(blocks.reshape(n, -1))


def _packed(x: torch.Tensor, panels: torch.Tensor, n: int) -> torch.Tensor:
    return torch.ops.weft.packed_linear(x, panels, None, n)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", default="576x3072", help="in x out features (default: SmolLM2's gate/up)")
    p.add_argument("--rows", default="1,8,32,128,1024,4096")
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--paths", default="", help="comma-separated substrings of the path names to run")
    args = p.parse_args()
    if not kernels_available():
        raise SystemExit("weft's CPU kernels are not available")
    k, n = (int(v) for v in args.shape.split("x"))
    weight = torch.randn(n, k) * 0.05
    bf16 = torch.ops.weft.pack_linear_weight(weight.bfloat16())
    f32 = torch.ops.weft.pack_linear_weight(weight)
    q8 = torch.ops.weft.pack_q8_0(q8_0_rows(weight))
    dot = {
        "Q8_0": torch.ops.weft.pack_dot(q8_0_rows(weight), "q8_0"),
        "Q4_K": torch.ops.weft.pack_dot(torch.ops.weft.quantize_q4_k(weight), "q4_k"),
        "Q6_K": torch.ops.weft.pack_dot(random_q6_k_rows(n, k), "q6_k"),
    }
    dense = weight.bfloat16().t().contiguous()
    print(f"ISA path {cpu_isa_path()} ({torch.ops.weft.build_info()}), {torch.get_num_threads()} threads")
    paths: dict[str, Callable[[torch.Tensor], object]] = {
        "bf16 weights, float32 products": lambda x: torch.ops.weft.packed_linear(x, bf16, None, n),
        "bf16 weights, bf16 products": lambda x: torch.ops.weft.packed_linear(x, bf16, None, n, True),
        "Q8_0 weights": lambda x: torch.ops.weft.packed_linear(x, q8, None, n),
        **{
            f"{kind} weights, int8 activations": functools.partial(_packed, panels=panels, n=n)
            for kind, panels in dot.items()
        },
        "float32 weights": lambda x: torch.ops.weft.packed_linear(x, f32, None, n),
        "oneDNN bf16 GEMM": lambda x: torch.mm(x.bfloat16(), dense),
    }
    wanted = [w for w in args.paths.split(",") if w]
    paths = {name: fn for name, fn in paths.items() if not wanted or any(w in name for w in wanted)}
    rows = [int(r) for r in args.rows.split(",")]
    print(f"| {k} x {n}, GFLOP/s | " + " | ".join(str(r) for r in rows) + " |")
    print("|---|" + "---:|" * len(rows))
    for name, fn in paths.items():
        cells = []
        for r in rows:
            x = torch.randn(r, k)
            cells.append(f"{2 * r * k * n / best_seconds(lambda: fn(x), args.repeats) / 1e9:.0f}")  # noqa: B023
        print(f"| {name} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
