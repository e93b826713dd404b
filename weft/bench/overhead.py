"""The engine's own cost per step, without the model: `weft bench overhead`.

On a GPU a decode step's forward takes 1-4 ms, and whatever the engine does around it on the host
adds to every token. This benchmark measures that work alone, on any machine.

Steps, in order:
  1. build a one-layer random checkpoint whose vocabulary is a real tokenizer's (default: Llama 3's,
     128,256 ids, from ../shared/data/tokenizers/llama3; `--tokenizer` for another);
  2. replace the model runner's forward with a stand-in that returns logits rows at once (copies of
     one fixed random block); the model inputs are still prepared, as that is host work;
  3. for each batch size and workload: add the batch, step until every row is decoding, then time
     `--steps` decode steps plain (the median is the step's time) and `--steps` more with every
     phase timed (exclusive of the phases inside it; the host phases are scaled to the plain time);
  4. with `--repeats R`, do 3. R times per case and keep the run of least host time (a shared
     machine's other work only ever adds time);
  5. print, per batch size, the host cost per step and per row and each phase's share.

Host phases are the engine's work in Python (schedule, prepare inputs, start the grammar mask fill,
build the sampling batch, read the sampled tokens back, update the sequences, detokenize and match
stop strings, format logprobs, build outputs). Device phases are tensor math that runs on the
accelerator in a GPU deployment (the stand-in forward, the sampler's operations, applying the
mask); on this CPU they are real work too, and are listed apart. `--profile FILE` also writes a
cProfile of the timed steps (read it with `python -m pstats FILE`).
"""

from __future__ import annotations

import argparse
import cProfile
import json
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from functools import wraps
from pathlib import Path
from typing import Any

import torch

from weft.bench.throughput import SHARED
from weft.engine.runner import StepLogits

LLAMA3_TOKENIZER = SHARED / "tokenizers" / "llama3"
PROMPT_LEN = 64
LONG_SCHEMA = {  # a JSON string that random logits rarely close: rows stay in the batch
    "type": "object",
    "properties": {"notes": {"type": "array", "items": {"type": "string"}}},
    "required": ["notes"],
}
WORKLOADS: dict[str, dict[str, Any]] = {
    "greedy": {"temperature": 0.0},
    "top-p": {"temperature": 0.8, "top_p": 0.9, "seed": 1},
    "json": {"temperature": 0.8, "seed": 1, "json_schema": LONG_SCHEMA},
    "top-5": {"temperature": 0.0, "logprobs": 5},
    "top-20": {"temperature": 0.0, "logprobs": 20},
    "n=4": {"temperature": 0.8, "seed": 1, "n": 4},
    "penalties": {
        "temperature": 0.0,
        "repetition_penalty": 1.1,
        "presence_penalty": 0.5,
        "frequency_penalty": 0.5,
    },
    "stop": {"temperature": 0.0, "stop": ["\n\n", "END", "###"]},
    "ngram": {"temperature": 0.0},  # greedy with speculation on (prompt lookup, k = 4, every draft verified)
}
SPECULATING = {"ngram"}
HOST_PHASES = [
    "schedule",
    "prepare",
    "mask start",
    "batch",
    "transfer",
    "update",
    "text+stop",
    "logprobs",
    "outputs",
    "other",
]
DEVICE_PHASES = ["forward*", "sample", "mask apply"]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--batch-sizes", default="1,32,128,256", help="comma-separated (default: 1,32,128,256)")
    p.add_argument(
        "--workloads", default=",".join(WORKLOADS), help=f"comma-separated of {', '.join(WORKLOADS)}"
    )
    p.add_argument("--steps", type=int, default=16, help="timed decode steps per case (default: 16)")
    p.add_argument(
        "--repeats",
        type=int,
        default=1,
        help="measure each case this many times and keep the run with the least host time (default: 1)",
    )
    p.add_argument("--tokenizer", type=Path, default=LLAMA3_TOKENIZER, help="a tokenizer directory")
    p.add_argument("--profile", type=Path, default=None, help="write a cProfile of the timed steps here")
    p.add_argument(
        "--device", default="cpu", help="cpu or cuda: where the stand-in logits live (default: cpu)"
    )
    p.add_argument("--json", type=Path, default=None, help="also write the results to this JSON file")


class PhaseClock:
    """Seconds per named phase; a phase inside another is not counted in the outer one."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)
        self.enabled = False
        self._stack: list[list[Any]] = []  # [name, start] of the open phases

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        if not self.enabled:
            yield
            return
        now = time.perf_counter()
        if self._stack:
            outer = self._stack[-1]
            self.seconds[outer[0]] += now - outer[1]
        self._stack.append([name, now])
        try:
            yield
        finally:
            now = time.perf_counter()
            inner = self._stack.pop()
            self.seconds[inner[0]] += now - inner[1]
            if self._stack:
                self._stack[-1][1] = now

    def wrap(self, fn: Callable[..., Any], name: str) -> Callable[..., Any]:
        @wraps(fn)
        def timed(*args: Any, **kwargs: Any) -> Any:
            with self.phase(name):
                return fn(*args, **kwargs)

        return timed


class StandInRunner:
    """The model runner with its forward replaced: the inputs are prepared, then logits rows come
    from one fixed random block, copied (the sampler changes them in place)."""

    def __init__(self, runner: Any, vocab_size: int, max_rows: int, clock: PhaseClock) -> None:
        self.runner, self.model, self.clock = runner, runner.model, clock
        gen = torch.Generator().manual_seed(0)
        logits = torch.randn(max_rows, vocab_size, generator=gen) * 3
        self.logits = logits.to(runner.device)  # [max_rows, V] float32
        self.out = torch.empty_like(self.logits)  # reused, as a device allocator would (no frees)

    def execute(self, sched: Any, in_flight: Any = None) -> StepLogits:
        with self.clock.phase("prepare"):
            self.runner.prepare(sched, in_flight)
        with self.clock.phase("forward*"):
            rows = sum(item.num_rows for item in sched.scheduled)  # the sampling rows and their drafts'
            return StepLogits(self.out[:rows].copy_(self.logits[:rows]), None, None, [])


class _TimedSampler:
    def __init__(self, sampler: Any, clock: PhaseClock) -> None:
        self.sampler, self.clock = sampler, clock

    def __call__(self, *args: Any) -> Any:
        with self.clock.phase("sample"):
            return self.sampler(*args)


@contextmanager
def instrumented(engine: Any, clock: PhaseClock) -> Iterator[None]:
    """Time the phases of `engine.step()`; everything is put back afterwards."""
    import weft.sample.transfer as transfer_module
    from weft.engine.positions import PositionOutputs
    from weft.engine.sequence import Sequence
    from weft.structured.manager import PendingFill

    class_patches = [
        (Sequence, "_append_text", "text+stop"),
        (PositionOutputs, "add", "logprobs"),
        (PendingFill, "apply", "mask apply"),
        (transfer_module.StepTransfer, "read", "transfer"),
        (transfer_module, "to_host", "transfer"),
    ]
    saved = [(owner, name, getattr(owner, name)) for owner, name, _ in class_patches]
    grammars = engine.grammars
    try:
        for owner, name, phase in class_patches:
            setattr(owner, name, clock.wrap(getattr(owner, name), phase))
        engine.sampling_batches.build = clock.wrap(engine.sampling_batches.build, "batch")
        engine.scheduler.schedule = clock.wrap(engine.scheduler.schedule, "schedule")
        engine.scheduler.accept = clock.wrap(engine.scheduler.accept, "update")
        grammars.start_fill = clock.wrap(grammars.start_fill, "mask start")
        engine._emit = clock.wrap(engine._emit, "outputs")
        yield
    finally:
        for owner, name, original in saved:
            setattr(owner, name, original)
        for obj, name in (
            (engine.scheduler, "schedule"),
            (engine.scheduler, "accept"),
            (grammars, "start_fill"),
            (engine.sampling_batches, "build"),
        ):
            obj.__dict__.pop(name, None)
        engine.__dict__.pop("_emit", None)


@contextmanager
def speculating(engine: Any) -> Iterator[None]:
    """The engine with prompt lookup on, drafting 4 tokens wherever it finds a match (the stand-in's
    rows repeat, so it often does): the host cost of drafting and verifying."""
    from weft.config import SpeculativeConfig
    from weft.engine.speculation import Speculation

    off = engine.speculation
    engine.speculation = Speculation(SpeculativeConfig(num_speculative_tokens=4))
    engine.speculation.adaptive = False
    try:
        yield
    finally:
        engine.speculation = off


def build_checkpoint(tokenizer_dir: Path, out: Path) -> Path:
    """A one-layer Llama with the tokenizer's vocabulary; its weights never run."""
    from tokenizers import Tokenizer

    vocab_size = Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json")).get_vocab_size(
        with_added_tokens=True
    )
    config = {
        "architectures": ["LlamaForCausalLM"],
        "vocab_size": vocab_size,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 1,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "max_position_embeddings": 4096,
        "tie_word_embeddings": True,
        "eos_token_id": [],
    }
    (out / "config.json").write_text(json.dumps(config))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        if (tokenizer_dir / name).is_file():
            (out / name).write_bytes((tokenizer_dir / name).read_bytes())
    _save_random_weights(config, out)
    return out


def _save_random_weights(config: dict[str, Any], out: Path) -> None:
    from safetensors.torch import save_file

    h, inter, v = config["hidden_size"], config["intermediate_size"], config["vocab_size"]
    d = h // config["num_attention_heads"]
    prefix = "model.layers.0."
    shapes = {
        "model.embed_tokens.weight": (v, h),
        "model.norm.weight": (h,),
        prefix + "input_layernorm.weight": (h,),
        prefix + "post_attention_layernorm.weight": (h,),
        prefix + "self_attn.q_proj.weight": (h, h),
        prefix + "self_attn.k_proj.weight": (d, h),
        prefix + "self_attn.v_proj.weight": (d, h),
        prefix + "self_attn.o_proj.weight": (h, h),
        prefix + "mlp.gate_proj.weight": (inter, h),
        prefix + "mlp.up_proj.weight": (inter, h),
        prefix + "mlp.down_proj.weight": (h, inter),
    }
    save_file(
        {name: torch.randn(shape) * 0.02 for name, shape in shapes.items()}, str(out / "model.safetensors")
    )


def measure_case(
    llm: Any,
    workload: str,
    batch: int,
    steps: int,
    clock: PhaseClock,
    profiler: cProfile.Profile | None = None,
) -> dict[str, Any]:
    """Time `steps` decode steps of `batch` rows of one workload, twice: plain (the step time, median)
    and instrumented (each phase's share; its timers cost a little, so the host phases are scaled to
    the plain step's host time)."""
    from weft import OutputKind, SamplingParams

    engine = llm.engine
    if workload in SPECULATING:
        with speculating(engine):
            return measure_case(llm, "greedy", batch, steps, clock, profiler) | {"workload": workload}
    kwargs = WORKLOADS[workload]
    num_prompts = max(1, batch // kwargs.get("n", 1))
    # DELTA outputs, as a server streams them: each step reports only what is new.
    params = SamplingParams(
        max_tokens=2 * steps + 12, ignore_eos=True, output_kind=OutputKind.DELTA, **kwargs
    )
    gen = torch.Generator().manual_seed(batch)
    vocab = engine.config.model.vocab_size  # prompts from the middle of it, away from special tokens
    prompts = torch.randint(vocab // 8, vocab - vocab // 8, (num_prompts, PROMPT_LEN), generator=gen).tolist()
    ids = [f"{workload}-{batch}-{i}" for i in range(num_prompts)]
    for request_id, prompt in zip(ids, prompts, strict=True):
        engine.add_request(request_id, prompt, params)
    while engine.stats().num_waiting or engine.stats().extra["num_computing_prompts"]:
        engine.step()
    for _ in range(2):  # forks admitted, first decode steps
        engine.step()
    clock.enabled = True
    host_s, device_s, rows = _timed_steps(engine, steps, clock, None)  # only the device phases timed
    clock.seconds.clear()
    with instrumented(engine, clock):
        detail_host, detail_device, _ = _timed_steps(engine, steps, clock, profiler)
    clock.enabled = False
    timed = sum(clock.seconds.values())
    clock.seconds["other"] = max(sum(detail_host) + sum(detail_device) - timed, 0.0)
    for request_id in ids:
        engine.abort_request(request_id)
    return {
        "workload": workload,
        "batch": batch,
        "rows_per_step": rows,
        "host_s": _median(host_s),
        "phases": _phase_shares(clock, steps, _median(host_s), _median(device_s)),
    }


def _timed_steps(
    engine: Any, steps: int, clock: PhaseClock, profiler: cProfile.Profile | None
) -> tuple[list[float], list[float], float]:
    """Host and device seconds of each of `steps` engine steps, and the mean number of rows."""
    host, device, rows = [], [], 0
    for _ in range(steps):
        rows += engine.stats().num_running
        before = sum(clock.seconds.get(name, 0.0) for name in DEVICE_PHASES)
        if profiler is not None:
            profiler.enable()
        start = time.perf_counter()
        engine.step()
        elapsed = time.perf_counter() - start
        if profiler is not None:
            profiler.disable()
        spent = sum(clock.seconds.get(name, 0.0) for name in DEVICE_PHASES) - before
        host.append(elapsed - spent)
        device.append(spent)
    return host, device, rows / steps


def _phase_shares(clock: PhaseClock, steps: int, host_s: float, device_s: float) -> dict[str, float]:
    """Seconds per step of each phase: the device phases as timed, the host phases as shares of the
    instrumented run scaled to the plain run's host time (the timers themselves cost a little)."""
    phases = {name: seconds / steps for name, seconds in clock.seconds.items()}
    timed_host = sum(v for k, v in phases.items() if k not in DEVICE_PHASES)
    scale = host_s / max(timed_host, 1e-12)
    shares = {name: phases.get(name, 0.0) * scale for name in HOST_PHASES}
    device_timed = sum(phases.get(name, 0.0) for name in DEVICE_PHASES)
    shares.update(
        {name: phases.get(name, 0.0) * device_s / max(device_timed, 1e-12) for name in DEVICE_PHASES}
    )
    return shares


def _median(values: list[float]) -> float:
    return sorted(values)[len(values) // 2]


def host_seconds(result: dict[str, Any]) -> float:
    return float(result["host_s"])


def print_table(results: list[dict[str, Any]], batch: int) -> None:
    print(f"\nbatch {batch}: microseconds per step (host phases, then device phases)")
    header = ["workload", "host/step", "host/row", *HOST_PHASES, *DEVICE_PHASES]
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    for r in (r for r in results if r["batch"] == batch):
        host = host_seconds(r)
        cells = [r["workload"], f"{host * 1e6:.0f}", f"{host * 1e6 / max(r['rows_per_step'], 1):.1f}"]
        cells += [f"{r['phases'].get(name, 0.0) * 1e6:.0f}" for name in [*HOST_PHASES, *DEVICE_PHASES]]
        print("| " + " | ".join(cells) + " |")


def run(args: argparse.Namespace) -> int:
    from weft import LLM

    tokenizer_dir: Path = args.tokenizer
    if not (tokenizer_dir / "tokenizer.json").is_file():
        raise FileNotFoundError(f"{tokenizer_dir}/tokenizer.json not found (pass --tokenizer DIR)")
    batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    workloads = args.workloads.split(",")
    unknown = set(workloads) - set(WORKLOADS)
    if unknown:
        raise ValueError(f"unknown workloads {sorted(unknown)}; choose from {', '.join(WORKLOADS)}")
    print(
        f"weft bench overhead: {tokenizer_dir.name} tokenizer, {args.steps} timed steps per case", flush=True
    )
    with tempfile.TemporaryDirectory() as tmp:
        path = build_checkpoint(tokenizer_dir, Path(tmp))
        llm = LLM(
            str(path),
            device=args.device,
            dtype="float32",
            max_model_len=PROMPT_LEN + 2 * args.steps + 32,  # each case times its steps twice
            max_num_seqs=max(batch_sizes),
            max_num_batched_tokens=max(batch_sizes) * PROMPT_LEN,
            enable_prefix_caching=False,
            show_progress=False,
        )
    results = _measure_all(llm, batch_sizes, workloads, args)
    for batch in batch_sizes:
        print_table(results, batch)
    if args.json:
        args.json.write_text(json.dumps({"tokenizer": str(tokenizer_dir), "results": results}, indent=2))
    return 0


def _measure_all(
    llm: Any, batch_sizes: list[int], workloads: list[str], args: argparse.Namespace
) -> list[Any]:
    engine, clock = llm.engine, PhaseClock()
    vocab = engine.config.model.vocab_size
    engine.runner = StandInRunner(engine.runner, vocab, 5 * max(batch_sizes), clock)  # drafts: 4 rows more
    engine.sampler = _TimedSampler(engine.sampler, clock)
    profiler = cProfile.Profile() if args.profile else None
    results = []
    measure_case(llm, "greedy", 1, 2, clock)  # warm-up: first calls
    for batch in batch_sizes:
        for workload in workloads:
            print(f"  batch {batch}: {workload}", flush=True)
            runs = [
                measure_case(llm, workload, batch, args.steps, clock, profiler) for _ in range(args.repeats)
            ]
            results.append(min(runs, key=host_seconds))  # the run least disturbed by the machine
    if profiler is not None:
        profiler.dump_stats(str(args.profile))
        print(f"profile of the timed steps written to {args.profile} (python -m pstats {args.profile})")
    return results
