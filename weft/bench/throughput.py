"""Prefill and decode throughput of weft against a reference engine: Hugging Face transformers
generate() on a safetensors checkpoint, llama.cpp on a GGUF file.

Steps, in order:
  1. the checkpoint: `--model` (a Hugging Face directory or a GGUF file), or a random-weight model
     of a real shape built from a config.json (default: SmolLM2-135M's) and saved once, so that
     both engines load the very same weights;
  2. measure the device's plain memory bandwidth (CPU: a large tensor reduction; CUDA: a
     device-to-device copy, bytes read and written);
  3. for each batch size, after an untimed warm-up: in one run per engine, the prefill time (until
     every sequence has its first new token) and the total time (`--output-len` new tokens, EOS
     ignored) of the same random prompts (token ids), in weft and in the reference; decode
     tokens/s = batch * (output_len - 1) / (total - prefill). The two engines alternate
     `--repeats` times in one process and each keeps its best run, so that a burst of load from
     other tenants of a shared machine does not decide the ratio; beside it, each weft run's decode
     ratio over the reference run right after it (the two runs of a pair most often share one
     memory speed, where the machine's moves from minute to minute);
  4. print one table with the weft/reference ratio per batch size, and weft's achieved
     weight-read bandwidth at batch 1 (weight bytes / seconds per decode step), and its share of
     the bandwidth limit (the tokens/s at which one step reads every weight at the plain bandwidth).

On a GGUF file the reference is llama.cpp through llama-cpp-python (weft/bench/llama_cpp.py), with
as many threads as weft has; weft's `--dtype` is then the precision of its activations and of the
file's float tensors (float32: the quantized products as llama.cpp computes them).

`--device cuda` runs both engines on the GPU (transformers with its default attention); the
reference workload of the CUDA path is `--config .../llama-3.2-1b/config.json --dtype bfloat16
--batch-sizes 1,16,64,256 --device cuda`.

Prefix caching is off in the benchmark, so repeated prompts are computed again each time.
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

import torch

from weft.bench.timing import Timing
from weft.engine.factory import describe_kernels
from weft.kv_format import kv_dtype_name
from weft.model.huge_pages import HugePageArena, huge_pages_available
from weft.model.llama import LlamaForCausalLM
from weft.model.moe import SparseMoE

SHARED = Path(__file__).resolve().parents[2].parent / "shared" / "data"
DEFAULT_CONFIG = SHARED / "configs" / "smollm2-135m-instruct" / "config.json"
DEFAULT_TOKENIZER = SHARED / "tokenizers" / "smollm2" / "tokenizer.json"
_RUN_IDS = itertools.count()


def add_shape_arguments(p: argparse.ArgumentParser, batch_sizes: str) -> None:
    """--config and --batch-sizes, shared by the benchmarks that build a random-weight model."""
    p.add_argument(
        "--config", type=Path, default=DEFAULT_CONFIG, help="config.json of the model shape to build"
    )
    p.add_argument("--batch-sizes", default=batch_sizes, help=f"comma-separated (default: {batch_sizes})")


def add_repeats_argument(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--repeats", type=int, default=3, help="alternating runs per engine, the best kept (default: 3)"
    )


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_shape_arguments(p, "1,8,32,64")
    p.add_argument(
        "--model",
        type=Path,
        default=None,
        help="measure this checkpoint instead of a random one built from --config: a Hugging Face "
        "directory (against transformers) or a GGUF file (against llama.cpp)",
    )
    p.add_argument(
        "--gguf-type",
        default=None,
        help="build the --config shape as a GGUF file of random blocks of this type instead: q4_k_m "
        "(llama.cpp's mix of Q4_K and Q6_K), q5_k_m, q8_0 or q4_0; measured against llama.cpp on the "
        "same file (families: Llama, Qwen3, Gemma 3, Qwen3-MoE)",
    )
    p.add_argument(
        "--num-layers",
        type=int,
        default=None,
        help="with --gguf-type: only the shape's first N layers (a slice of a model too large to hold)",
    )
    p.add_argument("--prompt-len", type=int, default=128, help="prompt tokens per sequence (default: 128)")
    p.add_argument(
        "--kv-cache-dtype",
        default="auto",
        help="weft's KV cache: auto, float32, bfloat16 or float16; llama.cpp's (flash attention on) is "
        "of the same type (default: auto, weft's choice for the model)",
    )
    experts = "a GGUF file's mixture of experts on CPU: its experts in weft's panels or the file's blocks"
    p.add_argument("--expert-weights", default="auto", choices=("auto", "panels", "file"), help=experts)
    p.add_argument("--output-len", type=int, default=128, help="new tokens per sequence (default: 128)")
    p.add_argument(
        "--dtype",
        default="float32",
        help="float32, bfloat16 or float16, or several comma-separated, measured in turn (default: float32)",
    )
    add_repeats_argument(p)
    p.add_argument("--device", default="cpu", help="cpu or cuda: where both engines run (default: cpu)")
    p.add_argument("--no-reference", "--no-transformers", action="store_true", help="measure weft alone")
    p.add_argument(
        "--static-cache",
        action="store_true",
        help="transformers with a static KV cache, which its generate() compiles with torch.compile "
        "(its fastest decode on a GPU; each batch size compiles once, in the untimed warm-up)",
    )
    p.add_argument(
        "--tensor-parallel-size",
        type=int,
        default=1,
        help="N > 1: weft on one rank against N ranks (CPU), and the collectives' cost (default: 1)",
    )
    p.add_argument("--json", type=Path, default=None, help="also write the results to this JSON file")
    p.add_argument(
        "--plot", type=Path, default=None, help="write a PNG of decode tokens/s against batch size per dtype"
    )


def build_checkpoint(config_path: Path, dtype: torch.dtype, out: Path) -> Path:
    import transformers

    if not config_path.is_file():
        raise FileNotFoundError(f"{config_path}: no such config.json (pass --config)")
    config = transformers.AutoConfig.from_pretrained(config_path.parent)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype)
    model.save_pretrained(out, safe_serialization=True)
    if DEFAULT_TOKENIZER.is_file() and config.vocab_size >= 49152:  # the SmolLM2 tokenizer fits
        (out / "tokenizer.json").write_bytes(DEFAULT_TOKENIZER.read_bytes())
    else:  # the benchmark feeds token ids: any tokenizer with one entry per id of the model will do
        from tokenizers import Tokenizer, models

        vocab = {f"<t{i}>": i for i in range(config.vocab_size)}
        Tokenizer(models.WordLevel(vocab, unk_token="<t0>")).save(str(out / "tokenizer.json"))
    return out


def read_bandwidth_gbs(device: torch.device | str = "cpu") -> float:
    """Plain memory bandwidth, best of 5: on CPU, GB/s read by summing a 512 MiB float32 tensor (in
    2 MB pages where weft puts its weights in them: 10-20% faster to read than 4 KB pages on a Zen
    3); on CUDA, GB/s read and written by a 1 GiB device-to-device copy."""
    device = torch.device(device)
    if device.type == "cuda":
        src = torch.ones(256 * 1024 * 1024, device=device)
        dst = torch.empty_like(src)
        best = min(_timed(lambda: dst.copy_(src), device) for _ in range(5))
        return 2 * src.numel() * 4 / best / 1e9
    data = torch.ones(128 * 1024 * 1024)
    if huge_pages_available():
        data = HugePageArena(data.numel() * 4).copy(data)
    best = min(_timed(lambda: data.sum()) for _ in range(5))
    return data.numel() * 4 / best / 1e9


def _timed(fn: Callable[[], object], device: torch.device | None = None) -> float:
    synchronize(device)
    start = time.perf_counter()
    fn()
    synchronize(device)
    return time.perf_counter() - start


def synchronize(device: torch.device | None) -> None:
    """Wait for the device's queued work (CUDA), so that a wall-clock reading covers it."""
    if device is not None and device.type == "cuda":
        torch.cuda.synchronize(device)


def time_weft(llm, prompts: list[list[int]], output_len: int) -> Timing:
    """One run: the prefill ends when every sequence has its first new token, the rest is decode
    (both from the same run, so a slow moment in one does not skew the difference)."""
    from weft import SamplingParams

    engine = llm.engine
    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    request_ids = [f"bench-{next(_RUN_IDS)}" for _ in prompts]
    started, lengths = set(), {}
    start, prefill, kv_bytes, kv_decode, decoded = time.perf_counter(), None, 0, 0, 0
    for request_id, prompt in zip(request_ids, prompts, strict=True):
        engine.add_request(request_id, prompt, params)
    while engine.has_unfinished_requests():
        held = engine.kv_bytes_held  # (before the step: its blocks are allocated, its last ones count)
        kv_bytes = max(kv_bytes, held)
        # while decoding: from the second decode step (before the first, the prompt's sliding-window
        # blocks that the window has passed are still held; its scheduling gives them back)
        kv_decode = max(kv_decode, held) if decoded > 0 else kv_decode
        decoded += prefill is not None
        for out in engine.step():
            if out.outputs[0].token_ids:
                started.add(out.request_id)
            if out.finished:
                lengths[out.request_id] = len(out.outputs[0].token_ids)
        if prefill is None and len(started) == len(request_ids):
            prefill = time.perf_counter() - start
    total = time.perf_counter() - start
    if set(lengths.values()) != {output_len} or prefill is None:  # never report a rate not measured
        raise RuntimeError(
            f"weft generated {sorted(set(lengths.values()))} tokens per sequence, not {output_len}"
        )
    return Timing(prefill_s=prefill, total_s=total, kv_bytes=kv_bytes, kv_decode_bytes=kv_decode)


def time_transformers(model, prompts: list[list[int]], output_len: int, **options) -> Timing:
    """One generate() call; a streamer marks the first new token, which ends the prefill."""
    from transformers.generation.streamers import BaseStreamer

    class FirstToken(BaseStreamer):
        def __init__(self) -> None:
            self.calls, self.at = 0, 0.0

        def put(self, value: torch.Tensor) -> None:  # first the prompt, then each new token
            self.calls += 1
            if self.calls == 2:
                self.at = time.perf_counter()

        def end(self) -> None:
            pass

    streamer = FirstToken()
    start, total = generate_exactly(model, prompts, output_len, do_sample=False, streamer=streamer, **options)
    if streamer.calls < 2:
        raise RuntimeError("transformers' streamer saw no new token")
    return Timing(prefill_s=streamer.at - start, total_s=total)


def generate_exactly(model, prompts: list[list[int]], output_len: int, **options) -> tuple[float, float]:
    """One transformers generate() of exactly `output_len` new tokens per prompt (EOS ignored), with
    `options`: (the perf_counter reading at its start, its seconds)."""
    input_ids = torch.tensor(prompts, device=model.device)
    with torch.inference_mode():
        synchronize(model.device)
        start = time.perf_counter()
        out = model.generate(
            input_ids=input_ids,
            attention_mask=torch.ones_like(input_ids),
            max_new_tokens=output_len,
            min_new_tokens=output_len,
            pad_token_id=0,
            **options,
        )
        synchronize(model.device)
        seconds = time.perf_counter() - start
    if out.shape[1] - input_ids.shape[1] != output_len:
        raise RuntimeError(
            f"transformers generated {out.shape[1] - input_ids.shape[1]} tokens, not {output_len}"
        )
    return start, seconds


def run(args: argparse.Namespace) -> int:
    dtypes = [name.strip() for name in args.dtype.split(",")]
    batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    device = torch.device(args.device)
    where = f"threads={torch.get_num_threads()}" if device.type == "cpu" else _device_name(device)
    print(
        f"weft bench throughput: {_subject(args)} dtype={args.dtype} prompt={args.prompt_len} "
        f"output={args.output_len} repeats={args.repeats} device={args.device} {where}",
        flush=True,
    )
    if args.model is not None and not args.model.exists():
        raise FileNotFoundError(f"{args.model}: no such checkpoint (--model)")
    runs = {name: _run_dtype(name, batch_sizes, args) for name in dtypes}
    if args.json:
        args.json.write_text(json.dumps({"model": str(_subject(args)), "runs": runs}, indent=2))
    if args.plot:
        from weft.bench.plot import plot_decode

        plot_decode(runs, args.plot, f"{_subject(args).name}, prompt {args.prompt_len}")
        print(f"wrote {args.plot}")
    return 0


def _subject(args: argparse.Namespace) -> Path:
    """What is measured: the --model checkpoint, or the --config whose shape is built."""
    if args.model is not None:
        return args.model
    return args.config.parent if args.gguf_type is None else args.config.parent / f"({args.gguf_type})"


def _device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"


def _run_dtype(name: str, batch_sizes: list[int], args: argparse.Namespace) -> dict[str, object]:
    """One dtype: a checkpoint stored in it (or --model), weft and the reference on it, the table."""
    from weft import LLM
    from weft.config import resolve_dtype

    device = torch.device(args.device)
    dtype = resolve_dtype(name, device)
    with tempfile.TemporaryDirectory() as tmp:
        if args.model is None:
            print(f"[{name}] building a random-weight checkpoint ...", flush=True)
        path, tokenizer = _checkpoint(args, dtype, Path(tmp))
        max_len = args.prompt_len + args.output_len + 8
        llm = LLM(
            str(path),
            tokenizer=tokenizer,
            dtype=dtype,
            device=device,
            max_model_len=max_len,
            max_num_seqs=max(batch_sizes),
            max_num_batched_tokens=max(2048, max(batch_sizes) * args.prompt_len),
            enable_prefix_caching=False,
            show_progress=False,
            kv_cache_dtype=args.kv_cache_dtype,
            expert_weights=args.expert_weights,
        )
        kv_dtype = kv_dtype_name(llm.engine.runner.kv_dtype)
        print(f"[{name}] weft: {describe_kernels(llm.kernels)}", flush=True)
        reference = None
        if not args.no_reference:
            reference = load_reference(path, dtype, device, args.static_cache, kv_dtype)
        try:
            results = _measure_all(llm, reference, batch_sizes, args)
        finally:
            if reference is not None:
                reference.close()
    weight_bytes = decode_weight_bytes(llm.engine.model)
    bandwidth = read_bandwidth_gbs(device)
    _print_table(results, args, weight_bytes, bandwidth, reference.name if reference else "reference")
    print(f"[{name}] what ran: {describe_kernels(llm.kernels)}")  # the ISA path and each precision
    return {
        "reference": None if reference is None else reference.name,
        "results": results,
        "read_bandwidth_gbs": bandwidth,
        "weight_bytes": weight_bytes,
        "kernels": llm.kernels,
    }


def _checkpoint(args: argparse.Namespace, dtype: torch.dtype, tmp: Path) -> tuple[Path, Path | None]:
    """(the checkpoint to measure, a tokenizer directory for it or None: its own)."""
    if args.model is not None:
        return args.model, None
    if args.gguf_type is None:
        return build_checkpoint(args.config, dtype, tmp), None
    from weft.bench.random_gguf import word_level_tokenizer, write_random_gguf

    vocab = json.loads(args.config.read_text())["vocab_size"]
    out = tmp / f"random-{args.gguf_type}.gguf"
    path = write_random_gguf(args.config, args.gguf_type, out, num_layers=args.num_layers)
    return path, word_level_tokenizer(vocab, tmp / "tokenizer")


class Reference(Protocol):
    """The engine weft is measured against: `time` runs a batch of prompts to exactly `output_len`
    new tokens each, greedy, timed as `time_weft` times weft."""

    name: str

    def time(self, prompts: list[list[int]], output_len: int) -> Timing: ...

    def close(self) -> None: ...


class TransformersReference:
    name = "transformers"

    def __init__(self, path: Path, dtype: torch.dtype, device: torch.device, static: bool = False) -> None:
        import transformers

        model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
        self.model = torch.nn.Module.to(model, device).eval()
        self.options = {"cache_implementation": "static"} if static else {}
        if static:
            self.name = "transformers (static cache, compiled)"

    def time(self, prompts: list[list[int]], output_len: int) -> Timing:
        return time_transformers(self.model, prompts, output_len, **self.options)

    def close(self) -> None:
        pass


def load_reference(
    path: Path,
    dtype: torch.dtype,
    device: torch.device,
    static: bool = False,
    kv_cache_dtype: str = "float16",
) -> Reference:
    """llama.cpp for a GGUF file (on the CPU, with weft's threads and a KV cache of `kv_cache_dtype`),
    transformers otherwise (with `static`, its static cache, compiled)."""
    from weft.model.gguf_checkpoint import is_gguf

    if not is_gguf(path):
        return TransformersReference(path, dtype, device, static)
    if device.type != "cpu":
        raise ValueError("the llama.cpp reference runs on the CPU: pass --no-reference with --device cuda")
    from weft.bench.llama_cpp import LlamaCppReference

    return LlamaCppReference(path, threads=torch.get_num_threads(), kv_cache_dtype=kv_cache_dtype)


def decode_weight_bytes(model: LlamaForCausalLM) -> int:
    """Bytes of weights one batch-1 decode step reads: every parameter once (a quantized matrix as
    its packed blocks), except that an untied embedding table is only looked up (one row), not
    streamed, and that of a mixture of experts only the `experts_per_token` experts a row is routed
    to are read."""
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    embed, head = model.embed.weight, model.lm_head.weight
    if embed is not head:
        total -= embed.numel() * embed.element_size()
    for module in model.modules():
        if isinstance(module, SparseMoE):
            experts = sum(p.numel() * p.element_size() for p in module.experts.parameters())
            total -= experts - experts * module.top_k // len(module.experts)
    return total


def _measure_all(
    llm, reference: Reference | None, batch_sizes: list[int], args: argparse.Namespace
) -> list[dict[str, Any]]:
    gen = torch.Generator().manual_seed(0)
    vocab = llm.config.model.vocab_size  # prompts are token ids drawn from the config's vocabulary
    # a prompt of the measured length: kernels compiled per shape (Triton's) compile here, untimed
    warm = torch.randint(3, vocab, (1, args.prompt_len), generator=gen).tolist()
    time_weft(llm, warm, 4)
    if reference is not None:
        reference.time(warm, 4)
    results = []
    for batch in batch_sizes:
        prompts = torch.randint(3, vocab, (batch, args.prompt_len), generator=gen).tolist()
        print(f"  batch {batch}:", end="", flush=True)
        weft_runs, ref_runs = [], []
        if reference is not None and getattr(
            args, "static_cache", False
        ):  # its compile, for this batch size, untimed
            reference.time(prompts, args.output_len)
        for _ in range(args.repeats):
            print(" weft", end="", flush=True)
            weft_runs.append(time_weft(llm, prompts, args.output_len))
            if reference is not None:
                print(f" {reference.name}", end="", flush=True)
                ref_runs.append(reference.time(prompts, args.output_len))
        w = Timing.best(weft_runs)
        decode_tps = w.decode_tps(batch, args.output_len)
        row: dict[str, Any] = {
            "batch": batch,
            "weft_prefill_tps": w.prefill_tps(batch, args.prompt_len),
            "weft_decode_tps": decode_tps,
            "weft_decode_step_s": batch / decode_tps,
        }
        if ref_runs:
            r = Timing.best(ref_runs)
            row["ref_prefill_tps"] = r.prefill_tps(batch, args.prompt_len)
            row["ref_decode_tps"] = r.decode_tps(batch, args.output_len)
            if r.kv_bytes is not None:
                row["ref_kv_bytes"] = r.kv_bytes
            row["decode_ratios"] = Timing.paired_decode_ratios(weft_runs, ref_runs, batch, args.output_len)
        if w.kv_bytes is not None:
            row["weft_kv_bytes"] = w.kv_bytes
            row["weft_kv_decode_bytes"] = w.kv_decode_bytes or 0
        ref_text = f", reference {row['ref_decode_tps']:.1f}" if "ref_decode_tps" in row else ""
        print(f" done: weft decode {decode_tps:.1f} tok/s{ref_text}", flush=True)  # kept if cut short
        results.append(row)
    return results


def _bandwidth_kind(device: str) -> str:
    return "device copy" if torch.device(device).type == "cuda" else "memory read"


def _print_paired_ratios(results: list[dict[str, Any]], reference: str) -> None:
    """The decode ratio of each weft run over the reference's run after it, and their median."""
    paired = [r for r in results if len(r.get("decode_ratios", ())) > 1]
    if paired:
        print(f"\ndecode ratio run by run (each weft run / the {reference} run after it):")
    for r in paired:
        ratios = r["decode_ratios"]
        listed = ", ".join(f"{x:.2f}" for x in ratios)
        print(f"  batch {r['batch']}: {listed} (median {statistics.median(ratios):.2f})")


def _print_table(
    results: list[dict[str, Any]],
    args: argparse.Namespace,
    weight_bytes: int,
    bandwidth: float,
    reference: str,
) -> None:
    print()
    print(
        f"| batch | weft prefill tok/s | {reference} prefill tok/s | ratio "
        f"| weft decode tok/s | {reference} decode tok/s | ratio |"
    )
    print("|---:|---:|---:|---:|---:|---:|---:|")
    for r in results:
        ref_p, ref_d = r.get("ref_prefill_tps"), r.get("ref_decode_tps")
        p_ratio = f"{r['weft_prefill_tps'] / ref_p:.2f}x" if ref_p else "-"
        d_ratio = f"{r['weft_decode_tps'] / ref_d:.2f}x" if ref_d else "-"
        ref_p_text, ref_d_text = (f"{ref_p:.0f}", f"{ref_d:.1f}") if ref_p and ref_d else ("-", "-")
        print(
            f"| {r['batch']} | {r['weft_prefill_tps']:.0f} | {ref_p_text} | {p_ratio} "
            f"| {r['weft_decode_tps']:.1f} | {ref_d_text} | {d_ratio} |"
        )
    _print_paired_ratios(results, reference)
    kv = [r for r in results if "weft_kv_bytes" in r]
    if kv:
        print(f"\nKV memory (MiB): weft's blocks held at most (while decoding) / {reference}'s cache")
        for r in kv:
            theirs = f"{r['ref_kv_bytes'] / 2**20:.1f}" if "ref_kv_bytes" in r else "-"
            mine = f"{r['weft_kv_bytes'] / 2**20:.1f} ({r['weft_kv_decode_bytes'] / 2**20:.1f})"
            print(f"  batch {r['batch']}: {mine} / {theirs}")
    batch1 = next((r for r in results if r["batch"] == 1), None)
    if batch1 is not None:
        achieved = weight_bytes / batch1["weft_decode_step_s"] / 1e9
        limit_tps = bandwidth * 1e9 / weight_bytes
        print(
            f"\nweft batch-1 decode streams {weight_bytes / 1e6:.0f} MB of weights per token: "
            f"{achieved:.1f} GB/s achieved vs {bandwidth:.1f} GB/s plain {_bandwidth_kind(args.device)} "
            f"({100 * achieved / bandwidth:.0f}%); bandwidth limit {limit_tps:.0f} tok/s, "
            f"weft {batch1['weft_decode_tps']:.1f} tok/s"
        )
