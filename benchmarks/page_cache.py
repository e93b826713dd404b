"""Two engines one after the other on one GGUF file: how much of the file each leaves in the page
cache, and how long each takes from its start to its first token, cold or after the other. Each
engine runs in a process of its own (weft: `LLM(FILE)` and one generated token; llama.cpp: its
model and context, one prompt of 16 tokens through `weft/bench/llama_cpp.py`); the page cache is
read with `fincore` and emptied of the file with posix_fadvise(POSIX_FADV_DONTNEED), which needs
no privileges.

    python benchmarks/page_cache.py /tmp/moe/q30b.gguf --order cold,llama.cpp,weft,llama.cpp,cold,weft

Engines: `weft` (its experts in its own panels), `weft-file` (`expert_weights="file"`: its experts
multiplied in the file's own blocks, from the page cache), `llama.cpp`.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

WEFT = """
import sys, time
start = time.perf_counter()
from weft import LLM, SamplingParams
llm = LLM(sys.argv[1], max_model_len=256, show_progress=False, expert_weights=sys.argv[2])
llm.generate([{"prompt_token_ids": list(range(100, 116))}], SamplingParams(max_tokens=1), use_tqdm=False)
print(time.perf_counter() - start)
"""

LLAMA_CPP = """
import sys, time
from pathlib import Path
start = time.perf_counter()
from weft.bench.llama_cpp import LlamaCppReference
reference = LlamaCppReference(Path(sys.argv[1]), threads=2)
reference.time([list(range(100, 116))], 2)
print(time.perf_counter() - start)
"""


def cached_gb(path: Path) -> float:
    """The file's bytes in the page cache now (`fincore`)."""
    out = subprocess.run(["fincore", "--bytes", "--noheadings", "--output", "RES", str(path)],
                         capture_output=True, text=True, check=True).stdout  # fmt: skip
    return int(out.split()[0]) / 1e9


def evict(path: Path) -> None:
    """Ask the kernel to drop the file's clean pages from the page cache."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def run(engine: str, path: Path) -> tuple[float, float]:
    """Seconds from the process's start to its first token, and its peak resident GB."""
    code = LLAMA_CPP if engine == "llama.cpp" else WEFT
    experts = "file" if engine == "weft-file" else "panels"
    process = subprocess.Popen([sys.executable, "-c", code, str(path), experts], stdout=subprocess.PIPE,
                               stderr=subprocess.DEVNULL, text=True)  # fmt: skip
    assert process.stdout is not None
    out = process.stdout.read()
    _, status, usage = os.wait4(process.pid, 0)
    if os.waitstatus_to_exitcode(status) != 0:
        raise RuntimeError(f"{engine} failed on {path}")
    return float(out.strip().splitlines()[-1]), usage.ru_maxrss * 1024 / 1e9


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("gguf", type=Path)
    p.add_argument("--order", default="cold,llama.cpp,weft,llama.cpp,cold,weft",
                   help="steps: an engine's run (weft, weft-file, llama.cpp), or 'cold' (the file out of "
                        "the page cache)")  # fmt: skip
    args = p.parse_args()
    size = args.gguf.stat().st_size / 1e9
    print(f"{args.gguf.name}: {size:.2f} GB; in the page cache at the start: {cached_gb(args.gguf):.2f} GB")
    print("| step | engine | cached before (GB) | to first token (s) | peak resident (GB) | cached after |")
    print("|---:|---|---:|---:|---:|---:|")
    for step, engine in enumerate(args.order.split(","), start=1):
        before = cached_gb(args.gguf)
        if engine == "cold":
            evict(args.gguf)
            time.sleep(1)
            print(f"| {step} | (evict) | {before:.2f} | | | {cached_gb(args.gguf):.2f} |", flush=True)
            continue
        seconds, peak = run(engine, args.gguf)
        after = cached_gb(args.gguf)
        print(f"| {step} | {engine} | {before:.2f} | {seconds:.1f} | {peak:.2f} | {after:.2f} |", flush=True)


if __name__ == "__main__":
    main()
