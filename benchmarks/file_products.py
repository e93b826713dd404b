"""Quantized products in the GGUF file's own blocks (`file_linear_rows`, weft/native/file_dot.cpp)
against the same matrices in dot panels (`packed_linear_rows`), alternating, best of `--rounds`:
`--experts` random matrices of `--rows` x `--features` (Q4_K or Q6_K blocks), 8 picked at random
for each call, one row of x each (a row's routed experts, as batch 1 of a mixture of experts
multiplies them). Few experts (8) keep them in the caches; many (96) make each call read memory.

    python benchmarks/file_products.py --kind q4_k --rows 1536 --features 2048 --experts 96
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch

from weft.native import kernels_available

BLOCK_BYTES = {"q4_k": 144, "q6_k": 210}
CODES = {"q4_k": 0, "q6_k": 1}


def random_blocks(kind: str, rows: int, features: int, rng: np.random.Generator) -> torch.Tensor:
    """Random blocks whose float16 scales are small and finite (uint8 [rows, bytes])."""
    size = BLOCK_BYTES[kind]
    raw = rng.integers(0, 256, size=(rows, features // 256, size), dtype=np.uint8)
    scales = rng.uniform(1e-3, 1e-2, size=(rows, features // 256, 2)).astype(np.float16).view(np.uint8)
    if kind == "q4_k":
        raw[:, :, 0:4] = scales.reshape(rows, features // 256, 4)
    else:
        raw[:, :, 208:210] = scales[:, :, 0:2]
        sub_scales = rng.integers(-60, 60, size=(rows, features // 256, 16)).astype(np.int8)
        raw[:, :, 192:208] = sub_scales.view(np.uint8)
    return torch.from_numpy(raw.reshape(rows, -1))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--kind", choices=sorted(BLOCK_BYTES), default="q4_k")
    p.add_argument("--rows", type=int, default=1536, help="output rows of each matrix")
    p.add_argument("--features", type=int, default=2048, help="input features (a multiple of 256)")
    p.add_argument("--experts", type=int, default=96)
    p.add_argument("--calls", type=int, default=400)
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args()
    if not kernels_available():
        raise SystemExit("weft's CPU kernels are not available here")
    from weft.model.quantized import QuantizedRows

    rng = np.random.default_rng(0)
    blocks = [random_blocks(args.kind, args.rows, args.features, rng) for _ in range(args.experts)]
    panels = [QuantizedRows(args.kind, b).pack(dot=True) for b in blocks]
    picks = [rng.permutation(args.experts)[:8].tolist() for _ in range(args.calls)]
    x = torch.randn(8, args.features)
    first = picks[0]
    same = torch.equal(
        torch.ops.weft.file_linear_rows(x, [blocks[e] for e in first], [CODES[args.kind]] * 8, 1),
        torch.ops.weft.packed_linear_rows(x, [panels[e] for e in first], args.rows),
    )
    print(f"{args.kind} {args.rows} x {args.features}, {args.experts} experts; the same numbers: {same}")

    def file_call(pick: list[int]) -> None:
        torch.ops.weft.file_linear_rows(x, [blocks[e] for e in pick], [CODES[args.kind]] * 8, 1)

    def panels_call(pick: list[int]) -> None:
        torch.ops.weft.packed_linear_rows(x, [panels[e] for e in pick], args.rows)

    runs = {"file blocks": (file_call, blocks), "dot panels": (panels_call, panels)}
    best = {name: float("inf") for name in runs}
    for _ in range(args.rounds):
        for name, (call, _) in runs.items():
            start = time.perf_counter()
            for pick in picks:
                call(pick)
            best[name] = min(best[name], (time.perf_counter() - start) / len(picks))
    for name, (_, weights) in runs.items():
        read = sum(weights[e].numel() for e in first)
        print(f"{name}: {best[name] * 1e6:.0f} us a call, {read / best[name] / 1e9:.1f} GB/s")
    print(f"ratio (panels' time / file's): {best['dot panels'] / best['file blocks']:.2f}x")


if __name__ == "__main__":
    main()
