"""`weft bench throughput --tensor-parallel-size N`: one rank against N, in one run, and what the
ranks' communication costs.

Steps, in order:
  1. build a random-weight checkpoint of the shape (`--config`), in the first of `--dtype`;
  2. load it on one rank and on N ranks (each engine given its own threads while it runs: N
     ranks share the cores);
  3. per batch size, the two engines alternate `--repeats` times (best run each): prefill and
     decode tokens/s;
  4. the collectives of one decode step, measured alone on this machine (two ranks in two threads,
     gloo over loopback, medians of 50): the all-reduce of [batch, hidden] float32 (2 per layer and
     1 for the embedding) and the gather of the logits ([batch, vocab / N] per rank), and their
     share of the N-rank decode step.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import torch

from weft.bench.throughput import Timing, build_checkpoint, describe_kernels, time_weft
from weft.parallel.group import TensorParallel, free_port


def run(args: argparse.Namespace) -> int:
    from weft import LLM
    from weft.config import resolve_dtype

    n = args.tensor_parallel_size
    if args.model is not None:
        raise ValueError("--tensor-parallel-size measures a random-weight model of --config: drop --model")
    batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    dtype = resolve_dtype(args.dtype.split(",")[0], torch.device("cpu"))
    threads = torch.get_num_threads()
    print(
        f"weft bench throughput: {args.config} tensor_parallel_size 1 vs {n}, "
        f"dtype {dtype}, threads {threads}"
    )
    with tempfile.TemporaryDirectory() as tmp:
        path = build_checkpoint(args.config, dtype, Path(tmp))
        options: dict[str, Any] = {
            "dtype": dtype,
            "device": "cpu",
            "max_model_len": args.prompt_len + args.output_len + 8,
            "max_num_seqs": max(batch_sizes),
            "max_num_batched_tokens": max(2048, max(batch_sizes) * args.prompt_len),
            "enable_prefix_caching": False,
            "show_progress": False,
        }
        one = LLM(str(path), **options)
        many = LLM(str(path), tensor_parallel_size=n, **options)
        print(f"what ran: {describe_kernels(one.kernels)}", flush=True)
        rows = _measure(one, many, batch_sizes, args, threads, max(1, threads // n))
        many.engine.shutdown()
    config = one.config.model
    comm = {
        b: collectives_s(b, config.hidden_size, config.vocab_size, n, config.num_layers) for b in batch_sizes
    }
    _print(rows, comm, n)
    return 0


def _measure(
    one: Any, many: Any, batch_sizes: list[int], args: argparse.Namespace, threads: int, rank_threads: int
) -> list[dict[str, float]]:
    gen = torch.Generator().manual_seed(0)
    vocab = one.config.model.vocab_size
    rows = []
    for batch in batch_sizes:
        prompts = torch.randint(3, vocab, (batch, args.prompt_len), generator=gen).tolist()
        runs: dict[str, list[Timing]] = {"one": [], "many": []}
        for _ in range(args.repeats):
            for name, llm, count in (("one", one, threads), ("many", many, rank_threads)):
                torch.set_num_threads(count)  # this process's share: all cores, or rank 0's
                runs[name].append(time_weft(llm, prompts, args.output_len))
        best = {name: Timing.best(timings) for name, timings in runs.items()}
        rows.append(
            {
                "batch": batch,
                **{f"{k}_prefill_tps": t.prefill_tps(batch, args.prompt_len) for k, t in best.items()},
                **{f"{k}_decode_tps": t.decode_tps(batch, args.output_len) for k, t in best.items()},
            }
        )
        print(f"  batch {batch}: done", flush=True)
    torch.set_num_threads(threads)
    return rows


def collectives_s(batch: int, hidden: int, vocab: int, world: int, layers: int) -> dict[str, float]:
    """Seconds per decode step of the all-reduces (2 per layer, 1 for the embedding) and the logits'
    gather, measured on two ranks in two threads (a world of 2; larger worlds cost more)."""
    reduce_s = _median_s(lambda tp, x: tp.all_reduce_(x), (batch, hidden))
    gather_s = _median_s(lambda tp, x: tp.gather_columns(x), (batch, vocab // world))
    return {"all_reduce_s": reduce_s, "gather_s": gather_s, "step_s": (2 * layers + 1) * reduce_s + gather_s}


def _median_s(op: Any, shape: tuple[int, int], rounds: int = 50) -> float:
    port, times = free_port(), []

    def rank(r: int) -> None:
        tp = TensorParallel.connect(r, 2, port, torch.device("cpu"), timeout_s=60)
        x = torch.randn(shape)
        for _ in range(rounds + 5):
            start = time.perf_counter()
            op(tp, x)
            if r == 0:
                times.append(time.perf_counter() - start)

    threads = [threading.Thread(target=rank, args=(r,)) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return statistics.median(times[5:])


def _print(rows: list[dict[str, float]], comm: dict[int, dict[str, float]], n: int) -> None:
    print(
        f"\n| batch | prefill tok/s, 1 rank | {n} ranks | ratio | decode tok/s, 1 rank | {n} ranks | ratio "
        "| all-reduce us | logits gather us | collectives per step ms | share of the step |"
    )
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        c = comm[int(r["batch"])]
        step_s = r["batch"] / r["many_decode_tps"]
        print(
            f"| {r['batch']:.0f} | {r['one_prefill_tps']:.0f} | {r['many_prefill_tps']:.0f} "
            f"| {r['many_prefill_tps'] / r['one_prefill_tps']:.2f}x | {r['one_decode_tps']:.1f} "
            f"| {r['many_decode_tps']:.1f} | {r['many_decode_tps'] / r['one_decode_tps']:.2f}x "
            f"| {1e6 * c['all_reduce_s']:.0f} | {1e6 * c['gather_s']:.0f} | {1e3 * c['step_s']:.2f} "
            f"| {100 * c['step_s'] / step_s:.0f}% |"
        )
