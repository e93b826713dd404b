"""Decode and prefill throughput of llama.cpp alone (through llama-cpp-python's low-level API,
weft/bench/llama_cpp.py) on a GGUF file, with the workload of `weft bench throughput`: random
prompts of --prompt-len token ids, --output-len new tokens, greedy, every sequence of a batch
decoded together in one llama_decode per step. `weft bench throughput --model FILE.gguf` runs the
same measurement alternating with weft's in one process; this script is llama.cpp's side alone,
for runs of one engine at a time. llama-cpp-python is not a weft dependency: the recipe is in
docs/benchmarks.md.

    python benchmarks/llama_cpp_decode.py model-q8_0.gguf --batch-sizes 1,8,32 --threads 2
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np

from weft.bench.llama_cpp import LlamaCppReference
from weft.bench.timing import Timing


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("gguf", type=Path)
    p.add_argument("--batch-sizes", default="1,8,32")
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--repeats", type=int, default=2, help="runs per batch size, the best kept")
    args = p.parse_args()
    reference = LlamaCppReference(args.gguf, args.threads)
    for batch in (int(b) for b in args.batch_sizes.split(",")):
        prompts = np.random.default_rng(batch).integers(3, reference.n_vocab, (batch, args.prompt_len))
        best = Timing.best([reference.time(prompts.tolist(), args.output_len) for _ in range(args.repeats)])
        row = {
            "batch": batch,
            "prefill_tps": best.prefill_tps(batch, args.prompt_len),
            "decode_tps": best.decode_tps(batch, args.output_len),
        }
        print(json.dumps(row), flush=True)
    reference.close()


if __name__ == "__main__":
    main()
