"""weft's decode speed at long contexts without computing the long prompts first.

    python benchmarks/long_context_decode.py MODEL.gguf --contexts 1024,4096,16384,32768 \\
        --kv-cache-dtypes float16,q8_0 --batch-sizes 1,4 [--json OUT.json] [--plot OUT.png]

A decode step's cost at context L is its weights and the keys and values of L tokens; their values
do not change it. On a 2-core machine a 32k prompt's prefill alone takes tens of minutes, so this
benchmark puts the context in the KV cache as a prefix-cache hit instead of computing it:

  1. every layer's cache is filled with random values of its type (valid Q8_0 blocks for q8_0), so
     that every page a step reads is real memory;
  2. for each prompt (random token ids, L - 1 of them), a stand-in sequence takes the blocks of its
     first L - 1 tokens, marks them computed and caches them (`KVCacheManager.cache_full_blocks`),
     then frees them: they stay in the prefix cache;
  3. the request itself then finds them there and computes only its last partial block, like any
     request after a cached prefix; its decode steps attend over all L tokens.

Decode tok/s is (tokens of a run of --output-len + 1 new tokens less a run of 1) over the difference
of their times, best of --repeats, per batch size, KV type and context. Prefill is not measured
(`weft bench throughput` measures it, against llama.cpp, where the context allows).
"""

from __future__ import annotations

import argparse
import json
import random
import time
from pathlib import Path
from typing import Any

import torch

from weft import LLM, SamplingParams
from weft.engine.sequence import Sequence
from weft.kv_format import Q8_0, quantize_q8_0


def fill_caches(llm: LLM) -> None:
    """Every layer's KV cache as random values of its type, block by block from one random block."""
    for cache in llm.engine.runner.kv_caches:  # [blocks, block_size, 2, KVH, row]
        head_dim = llm.engine.config.model.head_dim
        shape = (*cache.shape[1:-1], head_dim)
        values = torch.randn(shape, generator=torch.Generator().manual_seed(0))
        block = quantize_q8_0(values) if cache.dtype == Q8_0 else values.to(cache.dtype)
        for first in range(0, cache.shape[0], 256):
            chunk = cache[first : first + 256]
            chunk.copy_(block.expand_as(chunk))


def cache_prefix(llm: LLM, prompt: list[int]) -> None:
    """The KV blocks of `prompt`'s full blocks in the prefix cache, as if a request had computed them."""
    engine = llm.engine
    seq = Sequence.create(-1, SamplingParams(max_tokens=1), prompt, engine.limits, 0, engine.tokenizer)
    assert engine.kv.allocate_slots(seq, len(prompt)) is not None, "the KV cache cannot hold the context"
    seq.num_computed_tokens = len(prompt)
    engine.kv.cache_full_blocks(seq)
    engine.kv.free(seq.seq_id)


def decode_rate(llm: LLM, prompts: list[list[int]], output_len: int, repeats: int) -> float:
    """Decode tok/s over the batch: the best of `repeats` pairs of runs (1 and output_len + 1 tokens)."""
    best = 0.0
    for _ in range(repeats):
        times = []
        for max_tokens in (1, output_len + 1):
            params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
            start = time.perf_counter()
            llm.generate(prompts, params, use_tqdm=False)
            times.append(time.perf_counter() - start)
        best = max(best, len(prompts) * output_len / max(times[1] - times[0], 1e-9))
    return best


def measure(args: argparse.Namespace, kv_dtype: str, context: int, batch: int) -> dict[str, Any]:
    llm = LLM(
        args.model,
        kv_cache_dtype=kv_dtype,
        max_model_len=context + args.output_len + 16,
        max_num_seqs=batch,
        kv_cache_memory_gb=args.kv_memory_gb,
        show_progress=False,
    )
    rng = random.Random(context * 31 + batch)
    vocab = min(llm.engine.vocab_size, llm.engine.tokenizer.vocab_size)
    prompts = [[rng.randrange(1000, vocab) for _ in range(context - 1)] for _ in range(batch)]
    fill_caches(llm)
    for prompt in prompts:
        cache_prefix(llm, prompt)
    rate = decode_rate(llm, prompts, args.output_len, args.repeats)
    row = {"kv_cache_dtype": kv_dtype, "context": context, "batch": batch, "decode_tok_s": round(rate, 2)}
    row["isa"] = llm.kernels["isa"]
    row["kv_bytes_per_token"] = llm.engine.kv_bytes_per_token
    stats = llm.stats()  # the context came from the cache: hits of all but each prompt's last block
    row["prefix_hit_tokens"] = stats["prefix_cache_hit_tokens"]
    print(json.dumps(row), flush=True)
    return row


def plot(rows: list[dict[str, Any]], path: str, reference: list[dict[str, Any]] | None = None) -> None:
    """Decode tok/s against context, a line per KV type and batch size; `reference`: another
    engine's measured points (`weft bench throughput`, the same file), dashed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 4))
    for key in sorted({(r["kv_cache_dtype"], r["batch"]) for r in rows}):
        points = sorted(
            (r["context"], r["decode_tok_s"]) for r in rows if (r["kv_cache_dtype"], r["batch"]) == key
        )
        ax.plot(*zip(*points, strict=True), marker="o", label=f"weft, {key[0]} KV, batch {key[1]}")
    for key in sorted({(r["kv_cache_dtype"], r["batch"]) for r in reference or []}):
        mine = [r for r in reference or [] if (r["kv_cache_dtype"], r["batch"]) == key]
        points = sorted((r["context"], r["decode_tok_s"]) for r in mine)
        label = f"{mine[0]['engine']}, {key[0]} KV, batch {key[1]}"
        ax.plot(*zip(*points, strict=True), marker="s", linestyle="--", label=label)  # (a point: a marker)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("context (tokens)")
    ax.set_ylabel("decode tok/s")
    ax.legend(fontsize=8, bbox_to_anchor=(1.02, 1), loc="upper left")
    ax.grid(True, alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("model")
    parser.add_argument("--contexts", default="1024,4096,16384,32768")
    parser.add_argument("--kv-cache-dtypes", default="float16,q8_0")
    parser.add_argument("--batch-sizes", default="1,4")
    parser.add_argument("--output-len", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--kv-memory-gb", type=float, default=6.0)
    parser.add_argument("--json")
    parser.add_argument("--plot")
    parser.add_argument("--reference", help="a JSON list of another engine's points to draw beside weft's")
    parser.add_argument("--from-json", help="plot these rows (an earlier --json) instead of measuring")
    args = parser.parse_args()
    if args.from_json:
        rows = json.loads(Path(args.from_json).read_text())
    else:
        rows = [
            measure(args, kv_dtype, int(context), int(batch))
            for kv_dtype in args.kv_cache_dtypes.split(",")
            for batch in args.batch_sizes.split(",")
            for context in args.contexts.split(",")
        ]
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    if args.plot:
        reference = json.loads(Path(args.reference).read_text()) if args.reference else None
        plot(rows, args.plot, reference)


if __name__ == "__main__":
    main()
