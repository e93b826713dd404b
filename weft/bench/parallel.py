"""Parallel sampling and beam search of one prompt: time and KV memory, weft against the same
samples as independent requests and against transformers generate(), in one run.

Steps, in order:
  1. build a random-weight model of a real shape from a config.json (default: SmolLM2-135M's),
     saved once so that both engines load the very same weights;
  2. for each n in `--samples`: n samples (temperature 1, EOS ignored) of one `--prompt-len`-token
     prompt, `--output-len` new tokens each, (a) as one weft request with n samples sharing the
     prompt's KV blocks, (b) as n independent weft requests with prefix caching off, and
     (c) transformers generate(num_return_sequences=n);
  3. for each width in `--beam-widths`: weft beam_search against transformers
     generate(num_beams=width), EOS ignored by both so that both run every step;
  4. for each N in `--smc-particles`: one request of SMC over N particles under a regex (weighted
     output, so that every particle's tokens are counted) against n = N samples of the same
     prompt under the same regex: generated tokens/s of both and their peak KV;
  5. the SMC task with an exact answer (weft/bench/smc_task.py, the bundled model): masking's
     total variation to the target, and SMC's at each N, `--smc-runs` runs pooled;
  6. print time and peak KV per run. weft's peak is the most KV blocks in use at once (times the
     block size, in tokens); transformers' is its dense cache, one row per sequence. The ideal is
     the prompt once plus every sequence's own tokens.

The engines alternate `--repeats` times, each keeping its best time.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from weft.bench.throughput import add_repeats_argument, build_checkpoint, generate_exactly

SHARED = Path(__file__).resolve().parents[2].parent / "shared" / "data"
DEFAULT_CONFIG = SHARED / "configs" / "smollm2-135m-instruct" / "config.json"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", type=Path, default=DEFAULT_CONFIG, help="config.json of the model shape")
    p.add_argument("--samples", default="1,4,16,32", help="values of n, comma-separated (default: 1,4,16,32)")
    p.add_argument("--beam-widths", default="2,4,8", help="comma-separated (default: 2,4,8)")
    p.add_argument(
        "--smc-particles", default="4,16,64", help="SMC particle counts (default: 4,16,64; '' none)"
    )
    p.add_argument("--smc-runs", type=int, default=20, help="SMC runs pooled for the TV task (default: 20)")
    p.add_argument("--prompt-len", type=int, default=512, help="prompt tokens (default: 512)")
    p.add_argument("--output-len", type=int, default=64, help="new tokens per sequence (default: 64)")
    add_repeats_argument(p)
    p.add_argument("--no-transformers", action="store_true", help="measure weft alone")
    p.add_argument("--json", type=Path, default=None, help="also write the results to this JSON file")


def run_weft(llm, requests: list[tuple[list[int], object]], outputs: list | None = None) -> tuple[float, int]:
    """Run the requests to completion in one engine; (seconds, peak KV blocks in use). The
    finished outputs go to `outputs` when given."""
    engine = llm.engine
    start = time.perf_counter()
    for i, (prompt, params) in enumerate(requests):
        engine.add_request(f"bench-{i}", prompt, params)
    peak = 0
    while engine.has_unfinished_requests():
        finished = [o for o in engine.step() if o.finished]
        if outputs is not None:
            outputs += finished
        peak = max(peak, int(llm.stats()["kv_blocks_used"]))
    return time.perf_counter() - start, peak


def run_transformers(model, prompt: list[int], output_len: int, **options) -> float:
    return generate_exactly(model, [prompt], output_len, **options)[1]


def _best(repeats: int, fn: Callable[[], tuple[float, int]]) -> tuple[float, int]:
    runs = [fn() for _ in range(repeats)]
    return min(r[0] for r in runs), max(r[1] for r in runs)


def measure_samples(llm, hf, prompt: list[int], n: int, args: argparse.Namespace) -> dict[str, float]:
    from weft import SamplingParams

    params = SamplingParams(n=n, temperature=1.0, seed=0, max_tokens=args.output_len, ignore_eos=True)
    one = params.replace(n=1)
    block = llm.config.cache.block_size
    row: dict[str, float] = {"n": n, "ideal_kv_tokens": args.prompt_len + n * args.output_len}
    shared, independent, hf_times = [], [], []
    for _ in range(args.repeats):
        shared.append(run_weft(llm, [(prompt, params)]))
        independent.append(run_weft(llm, [(prompt, one.replace(seed=i)) for i in range(n)]))
        if hf is not None:
            hf_times.append(
                run_transformers(hf, prompt, args.output_len, do_sample=True, num_return_sequences=n)
            )
    row["weft_s"], row["weft_kv_tokens"] = min(t for t, _ in shared), max(p for _, p in shared) * block
    row["independent_s"] = min(t for t, _ in independent)
    row["independent_kv_tokens"] = max(p for _, p in independent) * block
    if hf_times:
        row["hf_s"], row["hf_kv_tokens"] = min(hf_times), n * (args.prompt_len + args.output_len)
    return row


def measure_beams(llm, hf, prompt: list[int], width: int, args: argparse.Namespace) -> dict[str, float]:
    from weft import BeamSearchParams

    params = BeamSearchParams(beam_width=width, max_tokens=args.output_len, ignore_eos=True)
    block = llm.config.cache.block_size
    row: dict[str, float] = {"width": width, "ideal_kv_tokens": args.prompt_len + width * args.output_len}
    weft_runs, hf_times = [], []
    for _ in range(args.repeats):
        weft_runs.append(run_weft(llm, [(prompt, params)]))
        if hf is not None:
            options = {"num_beams": width, "do_sample": False, "eos_token_id": None}
            hf_times.append(run_transformers(hf, prompt, args.output_len, **options))
    row["weft_s"], row["weft_kv_tokens"] = min(t for t, _ in weft_runs), max(p for _, p in weft_runs) * block
    if hf_times:
        row["hf_s"], row["hf_kv_tokens"] = min(hf_times), width * (args.prompt_len + args.output_len)
    return row


SMC_REGEX = "[a-z]+( [a-z]+)*"  # words: a constraint that keeps a random model going for max_tokens


def measure_smc(llm, prompt: list[int], particles: int, args: argparse.Namespace) -> dict[str, float]:
    """SMC over `particles` particles against n = `particles` samples, the same prompt, regex and
    length: generated tokens/s and peak KV of each."""
    from weft import SamplingParams

    samples = SamplingParams(
        regex=SMC_REGEX, n=particles, temperature=1.0, seed=0, max_tokens=args.output_len
    )
    smc = samples.replace(n=1, smc={"num_particles": particles, "output": "weighted"})
    assert samples.structured is not None
    llm.engine.grammars.validate(samples.structured)  # compiled (and cached) before the timing
    block = llm.config.cache.block_size
    row: dict[str, float] = {"N": particles, "ideal_kv_tokens": args.prompt_len + particles * args.output_len}
    for name, params in (("samples", samples), ("smc", smc)):
        best, peak, tokens = float("inf"), 0, 0
        for _ in range(args.repeats):
            outputs: list = []
            seconds, blocks = run_weft(llm, [(prompt, params)], outputs)
            best, peak = min(best, seconds), max(peak, blocks)
            tokens = sum(len(c.token_ids) for o in outputs for c in o.outputs)
            if name == "smc":
                row["resampling_steps"] = outputs[0].smc[0].num_resampling_steps
        row[f"{name}_tok_s"], row[f"{name}_kv_tokens"] = tokens / best, peak * block
    return row


def measure_smc_task(particle_counts: list[int], runs: int) -> list[dict[str, Any]]:
    """The choice tasks with an exact answer (weft/bench/smc_task.py), on the bundled model and,
    where it is installed, the default model: masking's TV to the target and SMC's at each N
    (`runs` runs of weighted particles pooled), and the seconds of SMC's runs."""
    from weft import LLM, bundled_model_path
    from weft.bench.smc_task import BUNDLED_TASK, DEFAULT_TASK
    from weft.engine.default_model import DEFAULT_MODEL

    seqs = max(256, max(particle_counts))
    tasks = [(BUNDLED_TASK, Path(bundled_model_path()))]
    default = DEFAULT_MODEL.path()
    if default is not None:
        tasks.append((DEFAULT_TASK, default))
    else:
        print(f"(the default model is not installed: its SMC task is skipped; {DEFAULT_MODEL.requirement})")
    rows = []
    for task, path in tasks:
        # float32 products: the model transformers' dequantized float32 copy computes
        llm = LLM(
            str(path), show_progress=False, dtype=torch.float32, max_num_seqs=seqs, matmul_precision="float32"
        )
        rows.append(_smc_task_row(llm, task, path, particle_counts, runs))
    return rows


def _smc_task_row(llm: Any, task: Any, path: Path, particle_counts: list[int], runs: int) -> dict[str, Any]:
    from weft import SamplingParams
    from weft.bench.smc_task import exact_choice_distributions, pooled, total_variation

    prompt = task.prompt_ids(llm)
    goal, masking, _ = exact_choice_distributions(path, prompt, task.options, tokenizer=llm.tokenizer)
    row: dict[str, Any] = {"task": task.name, "masking_tv": total_variation(masking, goal)}
    for n in particle_counts:
        smc = {"num_particles": n, "output": "weighted", "end_of_text": False}
        params = [
            SamplingParams(choice=task.options, max_tokens=16, seed=n * i, smc=smc) for i in range(runs)
        ]
        started = time.perf_counter()
        estimate, _ = pooled(llm.generate([prompt] * runs, params, use_tqdm=False))
        row[f"smc_{n}_s"] = time.perf_counter() - started
        row[f"smc_{n}_tv"] = total_variation(estimate, goal)
    return row


def run(args: argparse.Namespace) -> int:
    from weft import LLM

    samples = [int(n) for n in args.samples.split(",") if n]
    widths = [int(w) for w in args.beam_widths.split(",") if w]
    smc_counts = [int(n) for n in args.smc_particles.split(",") if n]
    print(
        f"weft bench parallel: {args.config} prompt={args.prompt_len} output={args.output_len} "
        f"repeats={args.repeats} threads={torch.get_num_threads()}",
        flush=True,
    )
    with tempfile.TemporaryDirectory() as tmp:
        print("building a random-weight checkpoint ...", flush=True)
        path = build_checkpoint(args.config, torch.float32, Path(tmp))
        most = max([*samples, *widths, *smc_counts, 1])
        llm = LLM(
            str(path),
            dtype=torch.float32,
            max_model_len=args.prompt_len + args.output_len + 8,
            max_num_seqs=max(most, 8),
            max_num_batched_tokens=max(2048, args.prompt_len + 2 * most),
            enable_prefix_caching=False,
            show_progress=False,
        )
        hf = None
        if not args.no_transformers:
            import transformers

            hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        vocab = llm.config.model.vocab_size
        prompt = torch.randint(
            3, vocab, (args.prompt_len,), generator=torch.Generator().manual_seed(0)
        ).tolist()
        run_weft(llm, [(prompt[:16], _warm_params())])  # untimed warm-up
        sample_rows = []
        for n in samples:
            print(f"  n={n} ...", flush=True)
            sample_rows.append(measure_samples(llm, hf, prompt, n, args))
        beam_rows = []
        for width in widths:
            print(f"  beam width {width} ...", flush=True)
            beam_rows.append(measure_beams(llm, hf, prompt, width, args))
        smc_rows = []
        for particles in smc_counts:
            print(f"  SMC over {particles} particles ...", flush=True)
            smc_rows.append(measure_smc(llm, prompt, particles, args))
    task = measure_smc_task(smc_counts, args.smc_runs) if smc_counts else []
    _print_tables(sample_rows, beam_rows)
    _print_smc(smc_rows, task)
    if args.json:
        results = {"samples": sample_rows, "beams": beam_rows, "smc": smc_rows, "smc_task": task}
        args.json.write_text(json.dumps(results, indent=2))
    return 0


def _warm_params() -> object:
    from weft import SamplingParams

    return SamplingParams(n=2, max_tokens=4)


def _ratio(a: float | None, b: float | None) -> str:
    return f"{a / b:.2f}x" if a and b else "-"


def _print_tables(sample_rows: list[dict[str, float]], beam_rows: list[dict[str, float]]) -> None:
    print("\nn samples of one prompt (time in s; KV peak in tokens, and / the ideal)")
    print(
        "| n | weft s | independent s | transformers s | speedup vs transformers "
        "| weft KV | independent KV | transformers KV | weft KV / ideal |"
    )
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in sample_rows:
        hf_s = r.get("hf_s")
        print(
            f"| {r['n']} | {r['weft_s']:.2f} | {r['independent_s']:.2f} | {hf_s or 0:.2f} "
            f"| {_ratio(hf_s, r['weft_s'])} | {r['weft_kv_tokens']:.0f} | {r['independent_kv_tokens']:.0f} "
            f"| {r.get('hf_kv_tokens', 0):.0f} | {r['weft_kv_tokens'] / r['ideal_kv_tokens']:.2f} |"
        )
    print("\nbeam search (time in s; KV peak in tokens)")
    print(
        "| width | weft s | transformers s | speedup vs transformers "
        "| weft KV | transformers KV | weft KV / ideal |"
    )
    print("|---:|---:|---:|---:|---:|---:|---:|")
    for r in beam_rows:
        hf_s = r.get("hf_s")
        print(
            f"| {r['width']} | {r['weft_s']:.2f} | {hf_s or 0:.2f} | {_ratio(hf_s, r['weft_s'])} "
            f"| {r['weft_kv_tokens']:.0f} | {r.get('hf_kv_tokens', 0):.0f} "
            f"| {r['weft_kv_tokens'] / r['ideal_kv_tokens']:.2f} |"
        )


def _print_smc(rows: list[dict[str, float]], tasks: list[dict[str, Any]]) -> None:
    if rows:
        print(
            f"\nSMC over N particles against n = N samples (regex {SMC_REGEX!r}; tok/s of generated tokens)"
        )
        print(
            "| N | samples tok/s | SMC tok/s | SMC / samples | resampling steps "
            "| samples KV | SMC KV | SMC KV / ideal |"
        )
        print("|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(
            f"| {r['N']} | {r['samples_tok_s']:.1f} | {r['smc_tok_s']:.1f} | "
            f"{r['smc_tok_s'] / r['samples_tok_s']:.2f} | {r['resampling_steps']:.0f} | "
            f"{r['samples_kv_tokens']:.0f} | {r['smc_kv_tokens']:.0f} | "
            f"{r['smc_kv_tokens'] / r['ideal_kv_tokens']:.2f} |"
        )
    for task in tasks:
        counts = [key[4:-3] for key in task if key.startswith("smc_") and key.endswith("_tv")]
        shown = ", ".join(f"N={n}: {task[f'smc_{n}_tv']:.3f} ({task[f'smc_{n}_s']:.1f} s)" for n in counts)
        print(f"\n{task['task']}, TV to the exact target: masking {task['masking_tv']:.3f}; SMC {shown}")
