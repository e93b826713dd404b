"""Times weft's GGUF-block product kernel (weft/cuda/quant.py) over tile shapes on a CUDA GPU: each
kind and Llama-3.2-1B matrix shape at decode (1 row) and prefill (128 rows), every BLOCK_N and
num_warps tried, GB/s of blocks read. `python benchmarks/quant_tiles.py` (a GPU is needed)."""

from __future__ import annotations

import numpy as np
import torch
import triton

from weft.bench.random_gguf import random_blocks
from weft.cuda.quant import CHUNK, KINDS, _quantized_linear_kernel


def time_tiles_or_none(*args: int | str | bool) -> float | None:
    """`time_tiles`, or None where the tile does not fit the GPU (shared memory, registers)."""
    try:
        return time_tiles(*args)  # type: ignore[arg-type]
    except triton.runtime.errors.OutOfResources:
        return None


def time_tiles(kind: str, n: int, k: int, m: int, block_m: int, block_n: int, warps: int, dot: bool) -> float:
    rows = torch.from_numpy(random_blocks(kind, n, k, np.random.default_rng(0)).reshape(-1)).cuda()
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    out = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
    code, block, size = KINDS[kind]
    row_bytes = k // block * size
    grid = (triton.cdiv(n, block_n), triton.cdiv(m, block_m))

    def launch() -> None:
        _quantized_linear_kernel[grid](
            x, rows, out, m, n, triton.cdiv(k, CHUNK), k // block, x.stride(0), row_bytes, out.stride(0),
            KIND=code, BLOCK_M=block_m, BLOCK_N=block_n, USE_DOT=dot, DOT_FP32=False, num_warps=warps,
        )  # fmt: skip

    return triton.testing.do_bench(launch, warmup=5, rep=20) * 1e-3


def main() -> None:
    for kind in ("q4_k", "q6_k"):
        for n, k in ((2048, 2048), (16384, 2048), (2048, 8192)):
            nbytes = n * k // KINDS[kind][1] * KINDS[kind][2]
            best = []
            for block_n in (1, 2, 4, 8, 16, 32):
                for warps in (1, 2, 4, 8):
                    s = time_tiles_or_none(kind, n, k, 1, 1, block_n, warps, False)
                    if s is not None:
                        best.append((s, block_n, warps))
            best.sort()
            top = ", ".join(f"N{b} w{w}: {nbytes / s / 1e9:.0f} GB/s" for s, b, w in best[:4])
            print(f"{kind} [{n}, {k}] decode: {top}", flush=True)
            dots = []
            for block_m, block_n, warps in (
                (64, 64, 4),
                (64, 128, 4),
                (64, 128, 8),
                (128, 128, 8),
                (32, 64, 4),
            ):
                s = time_tiles_or_none(kind, n, k, 128, block_m, block_n, warps, True)
                if s is not None:
                    dots.append((s, block_m, block_n, warps))
            dots.sort()
            top = ", ".join(
                f"M{a} N{b} w{w}: {2 * 128 * n * k / s / 1e12:.1f} TFLOP/s" for s, a, b, w in dots[:3]
            )
            print(f"{kind} [{n}, {k}] 128 rows: {top}", flush=True)


if __name__ == "__main__":
    main()
