"""`weft serve` under load, next to offline `LLM.generate` on the same workload.

Steps, in order:
  1. build a random-weight model of a real shape from a config.json (default: SmolLM2-135M's), or
     take `--model`;
  2. offline: `LLM.generate` of the whole workload at once (tokens/s), and the prefill time of one
     prompt (`max_tokens=1`, best of 5);
  3. start `weft serve` on a loopback port (a separate process, as deployed);
  4. for each concurrency C in `--concurrency`: C clients each send `--requests-per-client`
     streaming completions back to back, over HTTP with server-sent events (random token-id
     prompts of `--prompt-len`; output lengths drawn uniformly from [output_len / 2,
     3 * output_len / 2], EOS ignored, the same lengths offline); the clients start spread over
     the first `--ramp` seconds, as independent users do, rather than in lockstep (with equal
     starts and lengths, every request of a wave would arrive in the same step, and each
     prompt's first token would wait for all the wave's prefills). Requests/s, output tokens/s,
     time to first token and inter-token latency (p50/p99) are measured at the client;
  5. print one table; the ratios are server throughput / offline throughput and TTFT p99 / the
     offline prefill time of one prompt.

With `--base-url URL --model NAME` the same workload (step 4, the prompts drawn from `--config`'s
vocabulary) runs against any OpenAI-compatible server already running there: llama.cpp's
`llama-server`, vLLM, another weft. Steps 1-3 and the ratios are skipped; run the benchmark on weft
and on the peer in one sitting, with the same model, to compare them (docs/benchmarks.md).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit

import torch

from weft.bench.throughput import DEFAULT_CONFIG, build_checkpoint


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--config", type=Path, default=DEFAULT_CONFIG, help="config.json of the model shape to build"
    )
    p.add_argument(
        "--model",
        default=None,
        help="serve this checkpoint (a directory or a GGUF file; the bundled model: 'default') instead of "
        "building one; with --base-url, the model name to request",
    )
    p.add_argument(
        "--base-url",
        default=None,
        help="measure the OpenAI-compatible server at this URL (e.g. http://127.0.0.1:8080/v1) instead of "
        "starting weft serve",
    )
    p.add_argument("--api-key", default=None, help="with --base-url: sent as 'Authorization: Bearer KEY'")
    p.add_argument("--concurrency", default="1,8,32,64", help="concurrent clients, comma-separated")
    p.add_argument(
        "--requests-per-client", type=int, default=3, help="requests each client sends (default: 3)"
    )
    p.add_argument("--prompt-len", type=int, default=128, help="prompt tokens (default: 128)")
    p.add_argument("--output-len", type=int, default=64, help="new tokens per request (default: 64)")
    p.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=None,
        help="the engine's tokens per step, for the server and offline alike (default: the engine's)",
    )
    p.add_argument(
        "--ramp", type=float, default=2.0, help="seconds over which the clients start (default: 2)"
    )
    p.add_argument("--json", type=Path, default=None, help="also write the results to this JSON file")


@dataclass(slots=True)
class Run:
    ttft: list[float] = field(default_factory=list)
    itl: list[float] = field(default_factory=list)
    tokens: int = 0
    requests: int = 0


def _percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


@dataclass(frozen=True, slots=True)
class Job:
    prompt: list[int]
    output_len: int


@dataclass(frozen=True, slots=True)
class Target:
    """The server measured: where its completions endpoint is, and what each request names."""

    host: str
    port: int
    path: str  # e.g. /v1/completions
    model: str | None = None
    api_key: str | None = None

    @classmethod
    def of(cls, base_url: str, model: str | None, api_key: str | None) -> Target:
        url = urlsplit(base_url.rstrip("/"))
        if url.scheme != "http" or url.hostname is None:
            raise SystemExit(f"--base-url {base_url!r}: give an http:// URL such as http://127.0.0.1:8080/v1")
        return cls(url.hostname, url.port or 80, f"{url.path}/completions", model, api_key)


async def _one(target: Target, job: Job, run: Run) -> None:
    """One streaming completion over a raw HTTP/1.1 connection: a load generator this light
    leaves the (shared) cores to the server. Each data chunk with text or a token carries the
    tokens of one engine step (weft's text may be empty while a character waits for its last
    byte), so its arrival times them; the usage chunk counts them (without one: a token a chunk)."""
    request: dict[str, object] = {
        "prompt": job.prompt,
        "max_tokens": job.output_len,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if target.model is not None:
        request["model"] = target.model
    body = json.dumps(request).encode()
    auth = f"Authorization: Bearer {target.api_key}\r\n" if target.api_key else ""
    head = (
        f"POST {target.path} HTTP/1.1\r\nHost: {target.host}:{target.port}\r\n{auth}"
        f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\nConnection: close\r\n\r\n"
    ).encode()
    start = time.perf_counter()
    reader, writer = await asyncio.open_connection(target.host, target.port)
    writer.write(head + body)
    status = await reader.readline()
    if b" 200 " not in status:
        raise RuntimeError(f"the server answered {status!r}: {await reader.read()!r}")
    last, chunks, counted = None, 0, None
    async for line in _sse_lines(reader):
        if line.startswith(b"data: [DONE]"):
            break
        chunk = json.loads(line[6:])
        if chunk.get("usage"):
            counted = chunk["usage"]["completion_tokens"]
        choices = chunk.get("choices") or []
        if not choices or (not choices[0].get("text") and choices[0].get("finish_reason") is not None):
            continue  # the usage chunk, or a closing chunk: a finish reason, no new token
        now = time.perf_counter()
        if last is None:
            run.ttft.append(now - start)
        else:
            run.itl.append(now - last)
        last, chunks = now, chunks + 1
    writer.close()
    run.tokens += chunks if counted is None else counted
    run.requests += 1


async def _sse_lines(reader: asyncio.StreamReader) -> AsyncIterator[bytes]:
    """The data lines of an HTTP response body, chunked or not (headers skipped)."""
    chunked = False
    while header := (await reader.readline()).strip():
        chunked = chunked or header.lower() == b"transfer-encoding: chunked"
    pending = b""
    while True:
        if chunked:
            size = int((await reader.readline()).strip().split(b";")[0], 16)
            if size == 0:
                return
            pending += await reader.readexactly(size)
            await reader.readexactly(2)
        else:
            piece = await reader.read(65536)
            if not piece:
                return
            pending += piece
        *lines, pending = pending.split(b"\n")
        for line in lines:
            if line.startswith(b"data: "):
                yield line.rstrip(b"\r")


async def _load(
    jobs: list[Job], target: Target, concurrency: int, args: argparse.Namespace
) -> tuple[Run, float]:
    run = Run()

    async def worker(w: int) -> None:
        await asyncio.sleep(args.ramp * w / concurrency)
        for r in range(args.requests_per_client):
            await _one(target, jobs[(w * args.requests_per_client + r) % len(jobs)], run)

    start = time.perf_counter()
    await asyncio.gather(*(worker(w) for w in range(concurrency)))
    return run, time.perf_counter() - start


def _offline(path: str, jobs: list[Job], max_seqs: int, budget: int | None) -> tuple[float, float]:
    """(output tokens/s of the whole workload, seconds of one prompt's prefill)."""
    from weft import LLM, SamplingParams

    llm = LLM(
        path,
        max_num_seqs=max_seqs,
        max_num_batched_tokens=budget,
        enable_prefix_caching=False,
        show_progress=False,
    )
    params = SamplingParams(ignore_eos=True, seed=0)
    prompts = [job.prompt for job in jobs]
    llm.generate(prompts[:2], params.replace(max_tokens=4), use_tqdm=False)  # warm-up
    per_job = [params.replace(max_tokens=job.output_len) for job in jobs]
    start = time.perf_counter()
    outputs = llm.generate(prompts, per_job, use_tqdm=False)
    seconds = time.perf_counter() - start
    tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    prefill = []
    for prompt in prompts[:5]:
        start = time.perf_counter()
        llm.generate([prompt], params.replace(max_tokens=1), use_tqdm=False)
        prefill.append(time.perf_counter() - start)
    del llm
    return tokens / seconds, min(prefill)


def _healthy(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=1) as s:
            s.sendall(b"GET /health HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n")
            return s.recv(64).startswith(b"HTTP/1.1 200")
    except OSError:
        return False


def _start_server(path: str, port: int, max_seqs: int, budget: int | None) -> subprocess.Popen:
    command = [sys.executable, "-m", "weft", "serve", "--model", path, "--port", str(port)]
    command += ["--max-num-seqs", str(max_seqs), "--no-enable-prefix-caching", "--log-level", "warning"]
    if budget is not None:
        command += ["--max-num-batched-tokens", str(budget)]
    env = {k: v for k, v in os.environ.items() if k != "WEFT_API_KEY"}
    process = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError("weft serve exited before it came up")
        if _healthy(port):
            return process
        time.sleep(0.3)
    process.kill()
    raise RuntimeError("weft serve did not come up in 180 s")


def run(args: argparse.Namespace) -> int:
    levels = [int(c) for c in args.concurrency.split(",") if c]
    if args.base_url is not None:
        return _run_against(Target.of(args.base_url, args.model, args.api_key), levels, args)
    max_seqs = max(64, *levels)
    with tempfile.TemporaryDirectory() as tmp:
        if args.model is not None:
            from weft.engine.default_model import default_model_path
            from weft.engine.factory import resolve_model_path

            path = str(default_model_path() if args.model == "default" else resolve_model_path(args.model))
        else:
            print(f"building a random-weight checkpoint of {args.config} ...", flush=True)
            path = str(build_checkpoint(args.config, torch.float32, Path(tmp)))
        jobs = _jobs(_vocab_size(Path(path)), max(levels) * args.requests_per_client, args)
        _print_header(args)
        print("offline LLM.generate ...", flush=True)
        offline_tps, prefill_s = _offline(path, jobs, max_seqs, args.max_num_batched_tokens)
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        server = _start_server(path, port, max_seqs, args.max_num_batched_tokens)
        try:
            rows = _measure(jobs, Target("127.0.0.1", port, "/v1/completions"), levels, args)
        finally:
            server.terminate()
            server.wait(timeout=60)
    for row in rows:
        row["vs_offline"] = row["output_tps"] / offline_tps
        row["ttft_p99_vs_prefill"] = row["ttft_p99_ms"] / 1000 / prefill_s
    _print(rows, offline_tps, prefill_s)
    _write(args, {"offline_tps": offline_tps, "prefill_s": prefill_s, "rows": rows})
    return 0


def _run_against(target: Target, levels: list[int], args: argparse.Namespace) -> int:
    """The workload against a server already running at `--base-url`."""
    vocab = json.loads(args.config.read_text())["vocab_size"]
    jobs = _jobs(vocab, max(levels) * args.requests_per_client, args)
    _print_header(args)
    print(f"server: {args.base_url} (model {args.model!r})", flush=True)
    rows = _measure(jobs, target, levels, args)
    _print(rows, None, None)
    _write(args, {"base_url": args.base_url, "model": args.model, "rows": rows})
    return 0


def _jobs(vocab: int, count: int, args: argparse.Namespace) -> list[Job]:
    """Random token-id prompts of --prompt-len, output lengths uniform in [len/2, 3 len/2]."""
    gen = torch.Generator().manual_seed(0)
    prompts = torch.randint(3, vocab, (count, args.prompt_len), generator=gen).tolist()
    low, high = max(1, args.output_len // 2), max(1, 3 * args.output_len // 2)
    lengths = torch.randint(low, high + 1, (count,), generator=gen).tolist()
    return [Job(p, n) for p, n in zip(prompts, lengths, strict=True)]


def _vocab_size(path: Path) -> int:
    from weft.model.loader import load_config, open_source

    return load_config(open_source(path)).vocab_size


def _measure(jobs: list[Job], target: Target, levels: list[int], args: argparse.Namespace) -> list[dict]:
    rows = []
    for level in levels:
        print(f"  {level} concurrent clients ...", flush=True)
        load, seconds = asyncio.run(_load(jobs[: level * args.requests_per_client], target, level, args))
        rows.append(_row(level, load, seconds))
    return rows


def _print_header(args: argparse.Namespace) -> None:
    print(
        f"weft bench serve: prompt={args.prompt_len} output={args.output_len} "
        f"requests/client={args.requests_per_client} threads={torch.get_num_threads()}",
        flush=True,
    )


def _write(args: argparse.Namespace, results: dict) -> None:
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))


def _row(level: int, load: Run, seconds: float) -> dict[str, float]:
    return {
        "concurrency": level,
        "requests": load.requests,
        "output_tokens": load.tokens,
        "requests_per_s": load.requests / seconds,
        "output_tps": load.tokens / seconds,
        "ttft_p50_ms": 1000 * _percentile(load.ttft, 0.5),
        "ttft_p99_ms": 1000 * _percentile(load.ttft, 0.99),
        "itl_p50_ms": 1000 * _percentile(load.itl, 0.5),
        "itl_p99_ms": 1000 * _percentile(load.itl, 0.99),
        "itl_mean_ms": 1000 * statistics.fmean(load.itl) if load.itl else float("nan"),
    }


def _print(rows: list[dict[str, float]], offline_tps: float | None, prefill_s: float | None) -> None:
    """The table; the ratio columns only where weft's own offline run gave their denominators."""
    if offline_tps is not None and prefill_s is not None:
        print(
            f"\noffline LLM.generate: {offline_tps:.1f} output tok/s; "
            f"one prompt's prefill: {1000 * prefill_s:.1f} ms"
        )
    print(
        "| clients | req/s | output tok/s | vs offline | TTFT p50 ms | TTFT p99 ms "
        "| TTFT p99 / prefill | ITL p50 ms | ITL p99 ms |"
    )
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        vs = f"{r['vs_offline']:.2f}" if "vs_offline" in r else "-"
        vs_prefill = f"{r['ttft_p99_vs_prefill']:.2f}" if "ttft_p99_vs_prefill" in r else "-"
        print(
            f"| {r['concurrency']} | {r['requests_per_s']:.2f} | {r['output_tps']:.1f} | {vs} "
            f"| {r['ttft_p50_ms']:.1f} | {r['ttft_p99_ms']:.1f} | {vs_prefill} "
            f"| {r['itl_p50_ms']:.1f} | {r['itl_p99_ms']:.1f} |"
        )
