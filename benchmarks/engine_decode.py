"""Prefill and decode throughput of weft or vLLM's CPU build through their own offline Python APIs,
on the same checkpoint and workload: random prompts of --prompt-len token ids, --output-len new
tokens, greedy, EOS ignored, every prompt of a batch submitted at once. Prefill is the time of a run
with max_tokens=1; decode is a full run less that (best of --repeats each). Run each engine in its
own process (vLLM in its own virtual environment: it is not a weft dependency; the recipe is in
docs/benchmarks.md), alternating, and compare the printed JSON lines.

    python benchmarks/engine_decode.py CHECKPOINT --engine weft --dtype bfloat16 --batch-sizes 1,8,32
    VLLM_CPU_NUM_OF_RESERVED_CPU=0 VLLM_CPU_KVCACHE_SPACE=2 \\
        /path/to/vllm-venv/bin/python benchmarks/engine_decode.py CHECKPOINT --engine vllm ...
"""

from __future__ import annotations

import argparse
import json
import random
import time
from collections.abc import Callable
from typing import Any

Generate = Callable[[list[list[int]], int], list[int]]  # prompts, max_tokens -> output lengths


def weft_engine(args: argparse.Namespace, max_batch: int) -> tuple[Generate, int]:
    from weft import LLM, SamplingParams

    llm = LLM(
        args.checkpoint,
        dtype=args.dtype,
        max_num_seqs=max_batch,
        max_model_len=args.prompt_len + args.output_len + 8,
        max_num_batched_tokens=max(2048, max_batch * args.prompt_len),
        enable_prefix_caching=False,
        show_progress=False,
    )

    def generate(prompts: list[list[int]], max_tokens: int) -> list[int]:
        params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
        return [len(o.outputs[0].token_ids) for o in llm.generate(prompts, params, use_tqdm=False)]

    return generate, llm.config.model.vocab_size


def vllm_engine(args: argparse.Namespace, max_batch: int) -> tuple[Generate, int]:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(
        model=args.checkpoint,
        dtype=args.dtype,
        max_num_seqs=max_batch,
        max_model_len=args.prompt_len + args.output_len + 8,
        max_num_batched_tokens=max(2048, max_batch * args.prompt_len),
        enable_prefix_caching=False,
        seed=0,
    )

    def generate(prompts: list[list[int]], max_tokens: int) -> list[int]:
        params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
        inputs: Any = [TokensPrompt(prompt_token_ids=p) for p in prompts]
        return [len(o.outputs[0].token_ids) for o in llm.generate(inputs, params, use_tqdm=False)]

    return generate, llm.llm_engine.model_config.get_vocab_size()


def timed(generate: Generate, prompts: list[list[int]], max_tokens: int) -> float:
    start = time.perf_counter()
    lengths = generate(prompts, max_tokens)
    seconds = time.perf_counter() - start
    if set(lengths) != {max_tokens}:
        raise RuntimeError(f"expected {max_tokens} new tokens per prompt, got {sorted(set(lengths))}")
    return seconds


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("checkpoint")
    p.add_argument("--engine", choices=["weft", "vllm"], required=True)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--batch-sizes", default="1,8,32")
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--repeats", type=int, default=2, help="runs of each kind per batch size, the best kept")
    args = p.parse_args()
    batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    start = time.perf_counter()
    generate, vocab = (weft_engine if args.engine == "weft" else vllm_engine)(args, max(batch_sizes))
    print(json.dumps({"engine": args.engine, "dtype": args.dtype, "startup_s": time.perf_counter() - start}))
    timed(generate, [[5] * 8], 4)  # warm-up
    for batch in batch_sizes:
        rng = random.Random(batch)
        prompts = [[rng.randrange(3, vocab) for _ in range(args.prompt_len)] for _ in range(batch)]
        prefill = min(timed(generate, prompts, 1) for _ in range(args.repeats))
        total = min(timed(generate, prompts, args.output_len) for _ in range(args.repeats))
        row = {
            "engine": args.engine,
            "dtype": args.dtype,
            "batch": batch,
            "prefill_tps": batch * args.prompt_len / prefill,
            "decode_tps": batch * (args.output_len - 1) / max(total - prefill, 1e-9),
        }
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
