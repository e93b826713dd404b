"""What the KV cache's precision does to a real model's numbers: teacher-forced along llama.cpp's
recorded greedy continuations on the default model's file (tests/data/smollm2_q4_1_llama_cpp.json,
made by benchmarks/record_llama_cpp.py), weft's logprob of each of llama.cpp's tokens with a
float32, float16, bfloat16 and Q8_0 cache: the mean |difference| from llama.cpp's own and from the
float32 cache's.

    python benchmarks/kv_cache_drift.py [--model FILE.gguf] [--record JSON]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np

from weft import LLM, SamplingParams
from weft.engine.default_model import DEFAULT_MODEL

RECORD = Path(__file__).resolve().parents[1] / "tests" / "data" / "smollm2_q4_1_llama_cpp.json"


def teacher_forced(llm: LLM, runs: list[dict]) -> list[list[float]]:
    """For each run, weft's logprob of each of llama.cpp's tokens after the prompt and those before it."""
    params = SamplingParams(max_tokens=1, prompt_logprobs=0)
    logprobs = []
    for run in runs:
        out = llm.generate([list(run["ids"]) + list(run["tokens"])], params, use_tqdm=False)[0]
        rows = out.prompt_logprobs[len(run["ids"]) :] if out.prompt_logprobs else []
        pairs = zip(rows, run["tokens"], strict=True)
        logprobs.append([row[t].logprob for row, t in pairs if row is not None])
    return logprobs


def mean_gap(a: list[list[float]], b: list[list[float]]) -> float:
    pairs = [(x, y) for xs, ys in zip(a, b, strict=True) for x, y in zip(xs, ys, strict=True)]
    return float(np.mean([abs(x - y) for x, y in pairs]))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", type=Path, default=None, help="the GGUF file the record was made on")
    p.add_argument("--record", type=Path, default=RECORD)
    args = p.parse_args()
    model = args.model or DEFAULT_MODEL.path()
    if model is None:
        raise SystemExit("the default model is not installed: pass --model")
    runs = json.loads(args.record.read_text())["runs"]
    theirs = [list(run["logprobs"]) for run in runs]
    ours = {}
    print("| KV cache | mean abs dlogp vs llama.cpp | vs a float32 cache |")
    print("|---|---:|---:|")
    for dtype in ("float32", "float16", "bfloat16", "q8_0"):
        llm = LLM(str(model), show_progress=False, max_logprobs=5, kv_cache_dtype=dtype)
        ours[dtype] = teacher_forced(llm, runs)
        to_llama_cpp, to_float32 = mean_gap(ours[dtype], theirs), mean_gap(ours[dtype], ours["float32"])
        print(f"| {dtype} | {to_llama_cpp:.4f} | {to_float32:.4f} |")


if __name__ == "__main__":
    main()
