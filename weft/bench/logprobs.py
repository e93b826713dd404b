"""What logprobs cost: `weft bench logprobs`.

Steps, in order:
  1. build the same random-weight, real-shape model as `weft bench throughput` (default:
     SmolLM2-135M's config);
  2. for each batch size: decode time (`--output-len` new tokens less the first, greedy, EOS
     ignored) with logprobs off, 0 (the sampled token only), 5 and 20; the modes alternate
     `--repeats` times and each keeps its best run;
  3. prefill time of one `--prompt-len`-token prompt with and without `prompt_logprobs=5`;
  4. print decode tokens/s per mode and each mode's cost over "off".

On CPU the same runs also time the work logprobs add, where it happens: the sampler call, the
step's transfer and the records of each position (`PositionOutputs.add`). "work cost" is a
mode's extra seconds there over "off", divided by "off"'s decode time (medians over the repeats):
on a machine shared with other tenants it resolves a few percent that the end-to-end rates do not.
On a GPU the sampler runs asynchronously and the transfer waits for the whole step, so only the
end-to-end rates are meaningful there (`--device cuda`).
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from weft.bench.throughput import add_repeats_argument, add_shape_arguments, build_checkpoint

MODES: dict[str, int | None] = {"off": None, "0": 0, "5": 5, "20": 20}


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_shape_arguments(p, "1,8,32,64")
    p.add_argument(
        "--prompt-len", type=int, default=512, help="prompt tokens for prompt_logprobs (default: 512)"
    )
    p.add_argument("--output-len", type=int, default=32, help="new tokens per sequence (default: 32)")
    p.add_argument("--device", default="cpu", help="cpu or cuda (default: cpu)")
    add_repeats_argument(p)
    p.add_argument("--json", type=Path, default=None, help="also write the results to this JSON file")


class WorkClock:
    """Seconds spent in the parts of a step that logprobs add to (see the module's docstring)."""

    def __init__(self) -> None:
        self.seconds = 0.0

    def wrap(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        def timed(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - start

        return timed

    @contextmanager
    def timing(self, llm: Any) -> Iterator[None]:
        from weft.engine.positions import PositionOutputs
        from weft.sample.transfer import StepTransfer

        engine = llm.engine
        saved = (engine.sampler, StepTransfer.read, PositionOutputs.add)
        engine.sampler = self.wrap(engine.sampler)
        StepTransfer.read = self.wrap(StepTransfer.read)  # type: ignore[method-assign]
        PositionOutputs.add = self.wrap(PositionOutputs.add)  # type: ignore[method-assign]
        try:
            yield
        finally:
            engine.sampler, StepTransfer.read, PositionOutputs.add = saved  # type: ignore[method-assign]


def decode_seconds(llm: Any, prompts: list[list[int]], output_len: int, logprobs: int | None) -> float:
    """Seconds of the decode steps: generating `output_len` tokens less generating one."""
    from weft import SamplingParams

    def timed(num_tokens: int) -> float:
        params = SamplingParams(temperature=0, max_tokens=num_tokens, ignore_eos=True, logprobs=logprobs)
        start = time.perf_counter()
        outputs = llm.generate(prompts, params, use_tqdm=False)
        seconds = time.perf_counter() - start
        if {len(o.outputs[0].token_ids) for o in outputs} != {num_tokens}:
            raise RuntimeError(f"weft did not generate {num_tokens} tokens per sequence")
        return seconds

    return timed(output_len) - timed(1)


def prefill_seconds(llm: Any, prompt: list[int], prompt_logprobs: int | None) -> float:
    from weft import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=prompt_logprobs)
    start = time.perf_counter()
    llm.generate([prompt], params, use_tqdm=False)
    return time.perf_counter() - start


def measure(llm: Any, batch_sizes: list[int], args: argparse.Namespace) -> dict[str, Any]:
    gen = torch.Generator().manual_seed(0)
    vocab = llm.config.model.vocab_size
    decode_seconds(llm, torch.randint(3, vocab, (1, 8), generator=gen).tolist(), 4, 5)  # warm-up
    rows = []
    for batch in batch_sizes:
        prompts = torch.randint(3, vocab, (batch, 16), generator=gen).tolist()
        best = {mode: float("inf") for mode in MODES}
        decode: dict[str, list[float]] = {mode: [] for mode in MODES}
        work: dict[str, list[float]] = {mode: [] for mode in MODES}
        for _ in range(args.repeats):
            for mode, k in MODES.items():
                clock = WorkClock()
                with clock.timing(llm):
                    seconds = decode_seconds(llm, prompts, args.output_len, k)
                best[mode] = min(best[mode], seconds)
                decode[mode].append(seconds)
                work[mode].append(clock.seconds)
        tokens = batch * (args.output_len - 1)
        off_decode, off_work = statistics.median(decode["off"]), statistics.median(work["off"])
        work_cost = {f"work_{m}": (statistics.median(work[m]) - off_work) / off_decode for m in MODES}
        rows.append(
            {"batch": batch, **{f"tps_{m}": tokens / max(s, 1e-9) for m, s in best.items()}, **work_cost}
        )
        print(f"  batch {batch} done", flush=True)
    prompt = torch.randint(3, vocab, (args.prompt_len,), generator=gen).tolist()
    plain = min(prefill_seconds(llm, prompt, None) for _ in range(args.repeats))
    with_logprobs = min(prefill_seconds(llm, prompt, 5) for _ in range(args.repeats))
    return {"decode": rows, "prefill_s": plain, "prefill_prompt_logprobs_s": with_logprobs}


def print_results(results: dict[str, Any], args: argparse.Namespace) -> None:
    cpu = args.device == "cpu"
    header = (
        "| batch | off tok/s | logprobs=0 | logprobs=5 | logprobs=20 | cost of 0 | cost of 5 | cost of 20 |"
    )
    print("\n" + header + (" work cost of 0 | of 5 | of 20 |" if cpu else ""))
    print("|---:|---:|---:|---:|---:|---:|---:|---:|" + ("---:|---:|---:|" if cpu else ""))
    for r in results["decode"]:
        off = r["tps_off"]
        rates = [f"{r[f'tps_{m}']:.1f}" for m in MODES]
        costs = [f"{100 * (off / r[f'tps_{m}'] - 1):+.1f}%" for m in ("0", "5", "20")]
        if cpu:
            costs += [f"{100 * r[f'work_{m}']:+.1f}%" for m in ("0", "5", "20")]
        print(f"| {r['batch']} | {' | '.join(rates)} | {' | '.join(costs)} |")
    plain, with_lp = results["prefill_s"], results["prefill_prompt_logprobs_s"]
    print(
        f"\nprefill of a {args.prompt_len}-token prompt: {plain * 1e3:.1f} ms, with prompt_logprobs=5 "
        f"{with_lp * 1e3:.1f} ms ({100 * (with_lp / plain - 1):+.1f}%)"
    )


def run(args: argparse.Namespace) -> int:
    from weft import LLM

    batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    print(f"weft bench logprobs: {args.config} device={args.device} output={args.output_len}", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        path = build_checkpoint(args.config, torch.float32, Path(tmp))
        llm = LLM(
            str(path),
            device=args.device,
            dtype="float32",
            max_model_len=max(args.prompt_len, 16 + args.output_len) + 8,
            max_num_seqs=max(batch_sizes),
            max_num_batched_tokens=max(2048, args.prompt_len, max(batch_sizes) * 16),
            enable_prefix_caching=False,
            show_progress=False,
        )
    results = measure(llm, batch_sizes, args)
    print_results(results, args)
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))
    return 0
