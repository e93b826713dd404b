"""Where a decode step's time goes, kernel by kernel, on the device that runs it.

    python benchmarks/step_profile.py --device cuda --config CONFIG.json [--gguf-type q4_k_m] \
        [--batch-sizes 1,64] [--steps 16]

For each batch size: a random-weight checkpoint of the config (or, with --gguf-type, a GGUF file of
random blocks in that mix), that many prompts of --prompt-len tokens, stepped until every row
decodes; then --steps greedy decode steps timed plain (wall time a step), and --steps more under
`torch.profiler`; with `--logprobs 0,5`, the same again for each top-n logprobs. Printed per case:
the wall time a step, the device time a step (the sum of its kernels' times: what the device is
busy with), and the kernels grouped by what they do (matrix products, attention, norms, rotary and
KV writes, activation, sampling, copies), each with its time and launches a step; then the
costliest kernels by name. On CPU the kernels are the CPU operators (their self time), so the
script runs, and is tested, anywhere.
"""

from __future__ import annotations

import argparse
import re
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import torch

from weft.bench.throughput import build_checkpoint, synchronize

GROUPS = [  # (group, pattern of a kernel's name), first match wins
    ("whole layers (fused, CPU)", r"decoder_stack"),
    ("matrix products", r"gemv|gemm|cublas|cutlass|nvjet|sm\d+_xmma|matmul|addmm|aten::mm|linear|_quantized"),
    ("attention", r"attention|flash|_decode|merge|sdpa|softmax_kernel"),
    ("norms", r"rms_norm|layer_norm|rsqrt|aten::pow|aten::mean"),
    ("rotary + KV write", r"rope|write_kv|index_put|scatter|cat_|aten::cat"),
    ("activation", r"silu|gelu|swiglu"),
    ("sampling", r"argmax|topk|sort|row_max|isnan|masked_fill|log_softmax|exponential|multinomial|max"),
    ("copies", r"copy|memcpy|memset|fill|aten::to|clone"),
]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", type=Path, required=True, help="a model's config.json (its shape)")
    p.add_argument("--gguf-type", default=None, help="a GGUF mix of random blocks (q4_k_m, q8_0, ...)")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--batch-sizes", default="1,64")
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--steps", type=int, default=16)
    p.add_argument("--logprobs", default="0", help="comma-separated top-n logprobs to profile (0: none)")
    p.add_argument("--num-layers", type=int, default=None, help="fewer layers than the config's")
    args = p.parse_args(argv)
    batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    with tempfile.TemporaryDirectory() as tmp:
        llm = load(args, max(batch_sizes), Path(tmp))
    what = args.gguf_type or args.dtype
    print(f"step_profile: {args.config.parent.name}, {what}, on {device_name(torch.device(args.device))}")
    for batch in batch_sizes:
        for top in [int(n) for n in args.logprobs.split(",")]:
            wall, kernels = profile_batch(llm, batch, top, args)
            case = f"batch {batch}" + (f", top-{top} logprobs" if top else "")
            print_batch(case, wall, kernels, args.steps)
    return 0


def load(args: argparse.Namespace, max_batch: int, tmp: Path) -> Any:  # an LLM
    from weft import LLM

    tokenizer = None
    if args.gguf_type is None:
        dtype = getattr(torch, args.dtype)
        if args.num_layers is not None:
            raise SystemExit("--num-layers is for GGUF files; pass a config with fewer layers instead")
        path = build_checkpoint(args.config, dtype, tmp / "model")
    else:
        import json

        from weft.bench.random_gguf import word_level_tokenizer, write_random_gguf

        vocab = json.loads(args.config.read_text())["vocab_size"]
        path = write_random_gguf(args.config, args.gguf_type, tmp / "model.gguf", num_layers=args.num_layers)
        tokenizer = str(word_level_tokenizer(vocab, tmp / "tokenizer"))
    return LLM(
        str(path), tokenizer=tokenizer, dtype=args.dtype, device=args.device,
        max_model_len=args.prompt_len + 3 * args.steps + 16, max_num_seqs=max_batch,
        max_num_batched_tokens=max(2048, max_batch * args.prompt_len), enable_prefix_caching=False,
        show_progress=False,
    )  # fmt: skip


def profile_batch(
    llm: Any, batch: int, top: int, args: argparse.Namespace
) -> tuple[float, dict[str, list[float]]]:
    """(wall seconds a decode step, {kernel name: [seconds, launches]} over the profiled steps)."""
    from weft import SamplingParams

    engine, device = llm.engine, torch.device(args.device)
    vocab = engine.config.model.vocab_size
    gen = torch.Generator().manual_seed(batch)
    prompts = torch.randint(vocab // 8, vocab - vocab // 8, (batch, args.prompt_len), generator=gen)
    logprobs = top if top else None
    params = SamplingParams(temperature=0, max_tokens=3 * args.steps + 8, ignore_eos=True, logprobs=logprobs)
    ids = [f"profile-{batch}-{top}-{i}" for i in range(batch)]
    for request_id, prompt in zip(ids, prompts.tolist(), strict=True):
        engine.add_request(request_id, prompt, params)
    while engine.stats().num_waiting or engine.stats().extra["num_computing_prompts"]:
        engine.step()
    for _ in range(4):  # first decode steps: graphs replayed once, the lookahead filled
        engine.step()
    synchronize(device)
    start = time.perf_counter()
    for _ in range(args.steps):
        engine.step()
    synchronize(device)
    wall = (time.perf_counter() - start) / args.steps
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=activities) as prof:
        for _ in range(args.steps):
            engine.step()
        synchronize(device)
    for request_id in ids:
        engine.abort_request(request_id)
    return wall, kernel_times(prof, device)


def kernel_times(prof: torch.profiler.profile, device: torch.device) -> dict[str, list[float]]:
    """{name: [self seconds, count]}: the device's kernels on CUDA, the operators' self time on CPU."""
    times: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    for event in prof.events():
        if device.type == "cuda":
            if event.device_type != torch.autograd.DeviceType.CUDA:
                continue
            seconds = event.device_time_total * 1e-6  # a kernel: no children
        else:
            if not event.name.startswith(("aten::", "weft::")):
                continue
            seconds = event.self_cpu_time_total * 1e-6
        times[event.name][0] += seconds
        times[event.name][1] += 1
    return dict(times)


def group_of(name: str) -> str:
    for group, pattern in GROUPS:
        if re.search(pattern, name, re.IGNORECASE):
            return group
    return "other"


def print_batch(case: str, wall: float, kernels: dict[str, list[float]], steps: int) -> None:
    groups: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    for name, (seconds, count) in kernels.items():
        groups[group_of(name)][0] += seconds
        groups[group_of(name)][1] += count
    busy = sum(seconds for seconds, _ in kernels.values()) / steps
    print(f"\n{case}: {wall * 1e3:.3f} ms a step (wall), {busy * 1e3:.3f} ms of kernels a step")
    print("| group | ms a step | launches a step | share of the kernels |\n|---|---:|---:|---:|")
    for group, (seconds, count) in sorted(groups.items(), key=lambda item: -item[1][0]):
        share = seconds / steps / busy if busy else 0.0
        print(f"| {group} | {seconds / steps * 1e3:.3f} | {count / steps:.1f} | {share:.1%} |")
    print("| kernel | ms a step | launches a step |\n|---|---:|---:|")
    for name, (seconds, count) in sorted(kernels.items(), key=lambda item: -item[1][0])[:12]:
        print(f"| {name[:90]} | {seconds / steps * 1e3:.3f} | {count / steps:.1f} |")


def device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"


if __name__ == "__main__":
    sys.exit(main())
