"""Times weft's GGUF-block product kernels over their tile shapes on a CUDA GPU, in GB/s of blocks
read: for each kind and Llama-3.2-1B matrix shape, the decode kernels at one row (`block_gemv`:
float products; `block_gemv_q8`: int8 activations and dp4a, Q4_K and Q6_K) with every BLOCK_N and
num_warps tried, each with one program a column tile and with split-K as weft chooses it, and the
prompt kernel (`quant._quantized_linear_kernel`, `tl.dot`) at 128 rows.
`python benchmarks/quant_tiles.py` (a GPU is needed)."""

from __future__ import annotations

import itertools
from collections.abc import Callable

import numpy as np
import torch
import triton

from weft.bench.random_gguf import random_blocks
from weft.cuda import block_gemv, block_gemv_q8, split_k
from weft.cuda.quant import CHUNK, KINDS, _quantized_linear_kernel

SHAPES = ((2048, 2048), (16384, 2048), (2048, 8192))  # o, gate|up, down of Llama-3.2-1B
DECODE_TILES = ((8, 1), (16, 1), (32, 4))  # (BLOCK_N, num_warps)
PROMPT_TILES = ((64, 64, 4), (64, 128, 4), (128, 128, 8))  # (BLOCK_M, BLOCK_N, num_warps)


def seconds_or_none(launch: Callable[[], None]) -> float | None:
    """Best time of `launch`, or None where the tile does not fit the GPU (shared memory, registers)."""
    try:
        return triton.testing.do_bench(launch, warmup=5, rep=20) * 1e-3
    except triton.runtime.errors.OutOfResources:
        return None


def decode_launch(kernel: str, kind: str, w: torch.Tensor, x: torch.Tensor, out: torch.Tensor, n: int,
                  k: int, block_n: int, warps: int, split: int | None) -> Callable[[], None]:  # fmt: skip
    """A launch of a decode kernel on one tile shape; split None: as `split_k.split_for` chooses."""
    _, block, size = KINDS[kind]
    row_bytes = k // block * size
    grid, split, sums, counts = split_k.plan(x, n, block_n, triton.cdiv(k, CHUNK), split)
    if kernel == "int8":
        code, groups, words = block_gemv_q8.Q8_PLANES[kind]
        return lambda: block_gemv_q8._gemv_q8_kernel[grid](
            x, w, out, sums, counts, n, k // 256, x.stride(0), row_bytes, out.stride(0),
            KIND=code, G=groups, Q=words, BLOCK_N=block_n, COMPILED=True, SPLIT=split, num_warps=warps,
        )  # fmt: skip
    code, groups, width = block_gemv.PLANES[kind]
    return lambda: block_gemv._gemv_kernel[grid](
        x, w, out, sums, counts, n, triton.cdiv(k, CHUNK), k // block, x.stride(0), row_bytes, out.stride(0),
        KIND=code, G=groups, W=width, BLOCK_N=block_n, FMA=True, SPLIT=split, num_warps=warps,
    )  # fmt: skip


def prompt_launch(kind: str, w: torch.Tensor, x: torch.Tensor, out: torch.Tensor, n: int, k: int,
                  block_m: int, block_n: int, warps: int) -> Callable[[], None]:  # fmt: skip
    code, block, size = KINDS[kind]
    grid = (triton.cdiv(n, block_n), triton.cdiv(x.shape[0], block_m))
    return lambda: _quantized_linear_kernel[grid](
        x, w, out, x.shape[0], n, triton.cdiv(k, CHUNK), k // block, x.stride(0), k // block * size,
        out.stride(0), KIND=code, BLOCK_M=block_m, BLOCK_N=block_n, DOT_FP32=False, num_warps=warps,
    )  # fmt: skip


def main() -> None:
    for kind in ("q4_k", "q6_k"):  # Q4_K_M's kinds
        for n, k in SHAPES:
            w = torch.from_numpy(random_blocks(kind, n, k, np.random.default_rng(0)).reshape(-1)).cuda()
            nbytes = w.numel()
            x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
            out = torch.empty(1, n, device="cuda", dtype=torch.bfloat16)
            for kernel in ("float", "int8"):
                timed = []
                for (block_n, warps), split in itertools.product(DECODE_TILES, (1, None)):
                    launch = decode_launch(kernel, kind, w, x, out, n, k, block_n, warps, split)
                    s = seconds_or_none(launch)
                    if s is not None:
                        timed.append((s, block_n, warps, "1" if split == 1 else "auto"))
                timed.sort()
                best = timed[:3]
                top = ", ".join(f"N{b} w{wp} split {p}: {nbytes / s / 1e9:.0f} GB/s" for s, b, wp, p in best)
                print(f"{kind} [{n}, {k}] decode {kernel}: {top}", flush=True)
            x = torch.randn(128, k, device="cuda", dtype=torch.bfloat16)
            out = torch.empty(128, n, device="cuda", dtype=torch.bfloat16)
            dots = []
            for block_m, block_n, warps in PROMPT_TILES:
                s = seconds_or_none(prompt_launch(kind, w, x, out, n, k, block_m, block_n, warps))
                if s is not None:
                    dots.append((s, block_m, block_n, warps))
            dots.sort()
            flops = 2 * 128 * n * k
            top = ", ".join(f"M{a} N{b} w{wp}: {flops / s / 1e12:.1f} TFLOP/s" for s, a, b, wp in dots)
            print(f"{kind} [{n}, {k}] 128 rows: {top}", flush=True)


if __name__ == "__main__":
    main()
