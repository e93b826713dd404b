"""The CPU decode attention kernel alone (`torch.ops.weft.paged_decode_attention`) over one
sequence's paged cache, per KV-cache dtype and context length: milliseconds per layer and the
GB/s of cache it reads (compare with `weft bench throughput`'s plain read on the same machine).
The Llama-3.2-1B attention shape by default: 32 query heads over 8 KV heads of 64.

    python benchmarks/decode_attention.py --contexts 1024,4096,8192,32768 [--plot docs/decode-attention.png]
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from pathlib import Path

import torch

from weft.kv_format import quantize_q8_0
from weft.native import kernels_available

DTYPES: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "float32": lambda x: x,
    "float16": torch.Tensor.half,
    "bfloat16": torch.Tensor.bfloat16,
    "q8_0": quantize_q8_0,  # [..., D] -> [..., D / 32 * 34] uint8
}


def attention_ms(q: torch.Tensor, cache: torch.Tensor, table: torch.Tensor, lens: torch.Tensor) -> float:
    """Best of 5 runs of 10 calls, in ms per call, after 3 untimed ones."""
    scale = q.shape[-1] ** -0.5

    def step() -> None:
        torch.ops.weft.paged_decode_attention(q, cache, table, lens, scale)

    return best_ms(step)


def best_ms(step: Callable[[], None], repeats: int = 5, calls: int = 10) -> float:
    for _ in range(3):
        step()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(calls):
            step()
        best = min(best, (time.perf_counter() - start) / calls)
    return best * 1e3


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--contexts", default="1024,4096,8192,16384,32768", help="context lengths")
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--dtypes", default="float32,float16,bfloat16,q8_0")
    p.add_argument("--plot", type=Path, help="also draw ms per layer against the context to this PNG")
    p.add_argument("--rounds", type=int, default=2, help="sweeps over every context; each point its best")
    args = p.parse_args()
    if not kernels_available():
        raise SystemExit("weft's CPU kernels are not available (see the warning above)")
    d = args.head_dim
    print(f"threads {torch.get_num_threads()}, {args.heads} heads over {args.kv_heads} KV heads of {d}")
    names, contexts = args.dtypes.split(","), [int(c) for c in args.contexts.split(",")]
    results: dict[str, dict[int, float]] = {name: {} for name in names}
    gigabytes: dict[tuple[str, int], float] = {}
    for _ in range(args.rounds):  # (this VM's memory bandwidth moves over seconds: sweep again)
        sweep(args, contexts, names, results, gigabytes)
    print("| context | KV cache | ms per layer | GB/s of cache read |")
    print("|---:|---|---:|---:|")
    for context in contexts:
        for name in names:
            ms = results[name][context]
            print(f"| {context} | {name} | {ms:.3f} | {gigabytes[name, context] / ms * 1e3:.1f} |")
    if args.plot:
        plot(results, args.plot, f"{args.heads} heads over {args.kv_heads} KV heads of {d}")


def sweep(
    args: argparse.Namespace,
    contexts: list[int],
    names: list[str],
    results: dict[str, dict[int, float]],
    gigabytes: dict[tuple[str, int], float],
) -> None:
    """One pass over every context and KV type; each point keeps its best time so far."""
    block_size, d = 16, args.head_dim
    for context in contexts:
        num_blocks = -(-context // block_size)
        base = torch.randn(num_blocks, block_size, 2, args.kv_heads, d)  # [blocks, bs, 2, KVH, D]
        table = torch.arange(num_blocks).view(1, -1)  # [1, blocks]
        lens, q = torch.tensor([context]), torch.randn(1, args.heads, d)  # [1], [1, H, D]
        for name in names:
            cache = DTYPES[name](base)
            ms = attention_ms(q, cache, table, lens)
            gigabytes[name, context] = cache.nbytes / num_blocks / block_size * context / 1e9
            results[name][context] = min(ms, results[name].get(context, ms))


def plot(results: dict[str, dict[int, float]], out: Path, shape: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5.5, 4))
    for name, points in results.items():
        contexts = sorted(points)
        ax.plot(contexts, [points[c] for c in contexts], "o-", label=f"{name} KV cache")
    ax.set(xscale="log", yscale="log", xlabel="context (tokens)", ylabel="ms per layer, one sequence")
    ax.set_title(f"weft decode attention, {shape}", fontsize=10)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
