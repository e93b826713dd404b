"""The sampler's own work per step: `weft bench sampling`.

Steps, in order:
  1. random logits [B, V] (normal, scale 3; V = `--vocab`, default SmolLM2's 49,152), and one
     sampling batch per workload (greedy, temperature, top-p 0.9, top-k 50, min-p 0.05, top-5 and
     top-20 logprobs), each row its own seed;
  2. time `Sampler` on a fresh copy of the logits with the tensor operations (what every device
     runs without a kernel set of its own) and with this device's kernel set (on CPU: weft's native
     sampling, top-p and logprob passes), alternating `--repeats` times, medians;
  3. print milliseconds per step for both and their ratio, per batch size and workload, and check
     that both sampled the same tokens (they use the same keyed noise).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

WORKLOADS: dict[str, dict[str, Any]] = {
    "greedy": {"temperature": 0.0},
    "temperature": {"temperature": 0.8},
    "top-p 0.9": {"temperature": 0.8, "top_p": 0.9},
    "top-k 50": {"temperature": 0.8, "top_k": 50},
    "min-p 0.05": {"temperature": 0.8, "min_p": 0.05},
    "top-5 logprobs": {"temperature": 0.0, "logprobs": 5},
    "top-20 logprobs": {"temperature": 0.0, "logprobs": 20},
}


@dataclass
class _Row:
    """The fields of a sequence the sampler reads (`SamplingRow`)."""

    params: Any
    seed: int
    prompt_token_ids: list[int] = field(default_factory=lambda: [1, 2, 3])
    output_token_ids: list[int] = field(default_factory=list)
    eos_token_ids: frozenset[int] = frozenset({0})

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--batch-sizes", default="1,8,32,64", help="comma-separated (default: 1,8,32,64)")
    p.add_argument("--vocab", type=int, default=49152, help="vocabulary size (default: 49152)")
    p.add_argument("--workloads", default=",".join(WORKLOADS), help="comma-separated subset of the workloads")
    p.add_argument("--repeats", type=int, default=7, help="timed calls per side (default: 7)")
    p.add_argument("--json", type=Path, default=None, help="also write the results to this JSON file")


def measure(batch: int, vocab: int, workload: str, repeats: int) -> dict[str, Any]:
    from weft import SamplingParams
    from weft.engine.loading import kernels_for
    from weft.kernels import TORCH_KERNELS
    from weft.sample.sampler import Sampler, SamplingBatch

    cpu = torch.device("cpu")
    params = SamplingParams(**WORKLOADS[workload])
    rows = [_Row(params, seed) for seed in range(batch)]
    sampling = SamplingBatch.build(rows, vocab, cpu)
    logits = torch.randn(batch, vocab, generator=torch.Generator().manual_seed(batch)) * 3  # [B, V]
    sides = {"tensor ops": Sampler(kernels=TORCH_KERNELS), "kernel set": Sampler(kernels=kernels_for(cpu))}
    times: dict[str, list[float]] = {name: [] for name in sides}
    tokens: dict[str, list[int]] = {}
    for _ in range(repeats + 1):  # the first round warms up
        for name, sampler in sides.items():
            fresh = logits.clone()
            start = time.perf_counter()
            out = sampler(fresh, sampling)
            times[name].append(time.perf_counter() - start)
            tokens[name] = out.token_ids.tolist()
    tensor_ms, kernel_ms = (statistics.median(times[name][1:]) * 1e3 for name in sides)
    return {
        "batch": batch,
        "workload": workload,
        "tensor_ops_ms": tensor_ms,
        "kernel_set_ms": kernel_ms,
        "kernel_set": kernels_for(cpu).name,
        "same_tokens": tokens["tensor ops"] == tokens["kernel set"],
    }


def run(args: argparse.Namespace) -> int:
    batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    workloads = [w.strip() for w in args.workloads.split(",")]
    unknown = [w for w in workloads if w not in WORKLOADS]
    if unknown:
        raise SystemExit(f"weft bench sampling: unknown workloads {unknown}; choose from {list(WORKLOADS)}")
    print(f"weft bench sampling: vocabulary {args.vocab}, {args.repeats} calls per side, medians")
    results = [measure(b, args.vocab, w, args.repeats) for b in batch_sizes for w in workloads]
    print("\n| batch | workload | tensor ops ms | kernel set ms | speed-up | same tokens |")
    print("|---:|---|---:|---:|---:|---|")
    for r in results:
        speedup = r["tensor_ops_ms"] / max(r["kernel_set_ms"], 1e-9)
        print(
            f"| {r['batch']} | {r['workload']} | {r['tensor_ops_ms']:.2f} | {r['kernel_set_ms']:.2f} | "
            f"{speedup:.1f}x | {'yes' if r['same_tokens'] else 'no'} |"
        )
    if args.json is not None:
        args.json.write_text(json.dumps(results, indent=2))
    return 0
