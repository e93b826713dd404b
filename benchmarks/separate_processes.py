"""weft and llama.cpp on one GGUF file, each engine in a process of its own, alternating: for a
file that two engines cannot both hold in memory (the whole Qwen3-30B-A3B shape on a 24 GB
machine). Each round runs `weft bench throughput --model FILE --no-reference` and
`benchmarks/llama_cpp_decode.py FILE` once per batch size (the same workload: random token-id
prompts, greedy decode), the order flipped from round to round; each engine's best is kept, and
each process's peak resident memory (its own, from wait4) is reported beside the file's size.

    python benchmarks/separate_processes.py /tmp/moe/q30b.gguf --batch-sizes 1,8 --prompt-len 512 \
        --output-len 32 --rounds 2 [--repeats 3] [--weft-file]

weft runs with its experts in its own panels (`--expert-weights panels`); with `--weft-file`, also
with them in the file's own blocks (`--expert-weights file`), as a third engine in the rotation.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent


def _run(command: list[str]) -> tuple[str, float, float]:
    """stdout, peak resident GB (wait4's ru_maxrss) and seconds of one process."""
    start = time.perf_counter()
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    assert process.stdout is not None
    out = process.stdout.read()
    _, status, usage = os.wait4(process.pid, 0)
    process.returncode = os.waitstatus_to_exitcode(status)
    if process.returncode != 0:
        raise RuntimeError(f"{' '.join(command)} exited with {process.returncode}:\n{out[-2000:]}")
    return out, usage.ru_maxrss * 1024 / 1e9, time.perf_counter() - start


def run_weft(args: argparse.Namespace, batch: int, experts: str = "panels") -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "weft.json"
        command = [sys.executable, "-m", "weft", "bench", "throughput", "--model", str(args.gguf)]
        command += ["--expert-weights", experts]
        command += ["--no-reference", "--batch-sizes", str(batch), "--prompt-len", str(args.prompt_len)]
        command += ["--output-len", str(args.output_len), "--repeats", str(args.repeats), "--json", str(out)]
        _, peak, seconds = _run(command)
        (row,) = json.loads(out.read_text())["runs"]["float32"]["results"]
    prefill, decode = row["weft_prefill_tps"], row["weft_decode_tps"]
    return {"prefill": prefill, "decode": decode, "peak_gb": peak, "s": seconds}


def run_llama_cpp(args: argparse.Namespace, batch: int) -> dict:
    command = [sys.executable, str(HERE / "llama_cpp_decode.py"), str(args.gguf), "--batch-sizes", str(batch)]
    command += ["--prompt-len", str(args.prompt_len), "--output-len", str(args.output_len)]
    command += ["--repeats", str(args.repeats)]
    out, peak, seconds = _run(command)
    row = json.loads(out.strip().splitlines()[-1])
    return {"prefill": row["prefill_tps"], "decode": row["decode_tps"], "peak_gb": peak, "s": seconds}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("gguf", type=Path)
    p.add_argument("--batch-sizes", default="1,8")
    p.add_argument("--prompt-len", type=int, default=512)
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--rounds", type=int, default=2, help="alternating runs per engine, the best kept")
    p.add_argument("--repeats", type=int, default=1, help="timed runs in each process, its best kept")
    p.add_argument(
        "--weft-file",
        action="store_true",
        help="also weft with its experts in the file's own blocks (--expert-weights file), as a third engine",
    )
    args = p.parse_args()
    engines = {"weft": run_weft, "llama.cpp": run_llama_cpp}
    if args.weft_file:
        engines["weft (file)"] = lambda a, b: run_weft(a, b, "file")
    size = args.gguf.stat().st_size / 1e9
    print(f"{args.gguf} ({size:.2f} GB), prompt {args.prompt_len}, output {args.output_len}", flush=True)
    for batch in (int(b) for b in args.batch_sizes.split(",")):
        results: dict[str, list[dict]] = {name: [] for name in engines}
        for r in range(args.rounds):
            for name in list(engines)[:: 1 if r % 2 == 0 else -1]:
                result = engines[name](args, batch)
                results[name].append(result)
                print(f"batch {batch} round {r + 1} {name}: {json.dumps(result)}", flush=True)
        best = {n: (max(x["prefill"] for x in rs), max(x["decode"] for x in rs)) for n, rs in results.items()}
        peaks = {name: max(x["peak_gb"] for x in rs) for name, rs in results.items()}
        lp, ld = best["llama.cpp"]
        for name in (n for n in engines if n != "llama.cpp"):
            wp, wd = best[name]
            cells = [name, batch, f"{wp:.1f}", f"{lp:.1f}", f"{wp / lp:.2f}x", f"{wd:.2f}", f"{ld:.2f}"]
            cells += [f"{wd / ld:.2f}x", f"{peaks[name]:.2f}", f"{peaks['llama.cpp']:.2f}"]
            print("| " + " | ".join(str(c) for c in cells) + " |", flush=True)


if __name__ == "__main__":
    main()
