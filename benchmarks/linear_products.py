"""GFLOP/s of one matrix product in each of weft's CPU paths, at decode- and prefill-sized row counts.

    python benchmarks/linear_products.py [--shape 576x3072] [--rows 1,8,32,128,1024,4096]

Paths: bfloat16 weights with float32 products (widened in registers) and with bfloat16 products
(vdpbf16ps, or its emulation where the CPU lacks AVX512_BF16), Q8_0 weights (GGUF blocks, widened
with their scales), the int8-activation products of GGUF blocks (qdot.cpp: Q8_0 and Q4_K quantized
from the same weights, Q4_0, Q5_0 and Q6_K of random blocks: their speed does not depend on the
values), float32
weights, and oneDNN's bfloat16 GEMM (`torch.mm` on bfloat16 tensors, bfloat16 output) for
reference. Each is timed best of --repeats on the same random weights; the ISA path of weft's
kernels is printed first. --paths picks some (substrings of the names); --copies N cycles through
N copies of the weights, so that at one row the products stream them from memory as a model's
layers do, and prints the GB/s of weights read beside each GFLOP/s.
"""

from __future__ import annotations

import argparse
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


# kind -> (input features per block, bytes per block, offset of its float16 scale d)
RANDOM_BLOCKS = {"q4_0": (32, 18, 0), "q5_0": (32, 22, 0), "q6_k": (256, 210, 208)}


def random_rows(kind: str, n: int, k: int) -> torch.Tensor:
    """GGUF rows uint8 [N, K / block * block bytes] of random blocks with d = 0.01 (finite outputs):
    the speed of their products does not depend on the values."""
    block, size, d = RANDOM_BLOCKS[kind]
    blocks = np.random.default_rng(0).integers(0, 256, (n, k // block, size), dtype=np.uint8)
    blocks[:, :, d : d + 2] = np.array([0.01], dtype=np.float16).view(np.uint8)
    return torch.from_numpy(blocks.reshape(n, -1))


def rates(
    pack: Callable[[], torch.Tensor],
    run: Callable[[torch.Tensor, torch.Tensor], object],
    k: int,
    n: int,
    rows: list[int],
    args: argparse.Namespace,
) -> list[str]:
    """GFLOP/s of `run` at each row count over --copies packed copies of the weights (and the GB/s
    of weights read, with more than one)."""
    copies = [pack() for _ in range(args.copies)]
    nbytes = sum(w.numel() * w.element_size() for w in copies)
    cells = []
    for r in rows:
        x = torch.randn(r, k)
        seconds = best_seconds(lambda: [run(x, w) for w in copies], args.repeats)  # noqa: B023
        cell = f"{2 * r * k * n * len(copies) / seconds / 1e9:.0f}"
        cells.append(cell + (f" ({nbytes / seconds / 1e9:.1f})" if len(copies) > 1 else ""))
    return cells


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", default="576x3072", help="in x out features (default: SmolLM2's gate/up)")
    p.add_argument("--rows", default="1,8,32,128,1024,4096")
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--paths", default="", help="comma-separated substrings of the path names to run")
    p.add_argument(
        "--copies",
        type=int,
        default=1,
        help="multiply by this many copies of the weights in turn (more than the L3 holds: the rate "
        "from memory) and also print GB/s of weights read",
    )
    args = p.parse_args()
    if not kernels_available():
        raise SystemExit("weft's CPU kernels are not available")
    k, n = (int(v) for v in args.shape.split("x"))
    weight = torch.randn(n, k) * 0.05
    dense = weight.bfloat16().t().contiguous()
    # name -> (pack the weights, multiply x by the packed weights)
    packed = torch.ops.weft.packed_linear

    def product(x: torch.Tensor, w: torch.Tensor) -> object:
        return packed(x, w, None, n)

    paths: dict[str, tuple[Callable[[], torch.Tensor], Callable[[torch.Tensor, torch.Tensor], object]]] = {
        "bf16 weights, float32 products": (
            lambda: torch.ops.weft.pack_linear_weight(weight.bfloat16()),
            product,
        ),
        "bf16 weights, bf16 products": (
            lambda: torch.ops.weft.pack_linear_weight(weight.bfloat16()),
            lambda x, w: packed(x, w, None, n, True),
        ),
        "Q8_0 weights": (
            lambda: torch.ops.weft.pack_q8_0(q8_0_rows(weight)),
            product,
        ),
        "Q8_0 weights, int8 activations": (
            lambda: torch.ops.weft.pack_dot(q8_0_rows(weight), "q8_0"),
            product,
        ),
        "Q4_0 weights, int8 activations": (
            lambda: torch.ops.weft.pack_dot(random_rows("q4_0", n, k), "q4_0"),
            product,
        ),
        "Q5_0 weights, int8 activations": (
            lambda: torch.ops.weft.pack_dot(random_rows("q5_0", n, k), "q5_0"),
            product,
        ),
        "Q4_K weights, int8 activations": (
            lambda: torch.ops.weft.pack_dot(torch.ops.weft.quantize_q4_k(weight), "q4_k"),
            product,
        ),
        "Q6_K weights, int8 activations": (
            lambda: torch.ops.weft.pack_dot(random_rows("q6_k", n, k), "q6_k"),
            product,
        ),
        "float32 weights": (
            lambda: torch.ops.weft.pack_linear_weight(weight),
            product,
        ),
        "oneDNN bf16 GEMM": (lambda: dense.clone(), lambda x, w: torch.mm(x.bfloat16(), w)),
    }
    if k % 256:
        print(f"(Q4_K and Q6_K blocks hold 256 input features; {k} is not a multiple: skipped)")
        paths = {name: fn for name, fn in paths.items() if not name.startswith(("Q4_K", "Q6_K"))}
    wanted = [w for w in args.paths.split(",") if w]
    paths = {name: fn for name, fn in paths.items() if not wanted or any(w in name for w in wanted)}
    rows = [int(r) for r in args.rows.split(",")]
    print(f"ISA path {cpu_isa_path()} ({torch.ops.weft.build_info()}), {torch.get_num_threads()} threads")
    unit = "GFLOP/s" + (f" (GB/s of weights read), over {args.copies} copies" if args.copies > 1 else "")
    print(f"| {k} x {n}, {unit} | " + " | ".join(str(r) for r in rows) + " |")
    print("|---|" + "---:|" * len(rows))
    for name, (pack, run) in paths.items():
        print(f"| {name} | " + " | ".join(rates(pack, run, k, n, rows, args)) + " |")


if __name__ == "__main__":
    main()
