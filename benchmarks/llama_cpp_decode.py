"""Decode and prefill throughput of llama.cpp (through llama-cpp-python's low-level API) on a GGUF
file, with the workload of `weft bench throughput`: random prompts of --prompt-len tokens,
--output-len new tokens, greedy, every sequence of a batch decoded together in one llama_decode per
step. Run it in its own virtual environment (llama-cpp-python is not a weft dependency); the recipe
is in docs/benchmarks.md.

    python benchmarks/llama_cpp_decode.py model-bf16.gguf --batch-sizes 1,8,32 --threads 2
"""

from __future__ import annotations

import argparse
import ctypes
import json
import time

import llama_cpp as ll
import numpy as np


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("gguf")
    p.add_argument("--batch-sizes", default="1,8,32")
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--repeats", type=int, default=2, help="runs per batch size, the best kept")
    args = p.parse_args()
    ll.llama_backend_init()
    model = ll.llama_model_load_from_file(args.gguf.encode(), ll.llama_model_default_params())
    n_vocab = ll.llama_vocab_n_tokens(ll.llama_model_get_vocab(model))
    rows = []
    for batch in (int(b) for b in args.batch_sizes.split(",")):
        ctx = _context(model, batch, args)
        prompts = np.random.default_rng(batch).integers(3, n_vocab, (batch, args.prompt_len))
        best = min((_run(ctx, prompts, n_vocab, args.output_len) for _ in range(args.repeats)), key=sum)
        prefill, decode = best
        rows.append(
            {
                "batch": batch,
                "prefill_tps": batch * args.prompt_len / prefill,
                "decode_tps": batch * (args.output_len - 1) / decode,
            }
        )
        print(json.dumps(rows[-1]), flush=True)
        ll.llama_free(ctx)


def _context(model, batch: int, args: argparse.Namespace):
    params = ll.llama_context_default_params()
    params.n_ctx = batch * (args.prompt_len + args.output_len + 8)
    params.n_batch = params.n_ubatch = max(512, batch * args.prompt_len)
    params.n_seq_max = batch
    params.n_threads = params.n_threads_batch = args.threads
    params.kv_unified = False  # a cache stream per sequence: each attends over its own tokens only
    return ll.llama_init_from_model(model, params)


def _run(ctx, prompts: np.ndarray, n_vocab: int, output_len: int) -> tuple[float, float]:
    """Seconds of the prefill (with its first token) and of the remaining output_len - 1 steps."""
    ll.llama_memory_clear(ll.llama_get_memory(ctx), True)
    batch, prompt_len = prompts.shape
    start = time.perf_counter()
    tokens = _decode(ctx, [list(p) for p in prompts], [0] * batch, n_vocab)
    prefill = time.perf_counter() - start
    start = time.perf_counter()
    for step in range(output_len - 1):
        tokens = _decode(ctx, [[t] for t in tokens], [prompt_len + step] * batch, n_vocab)
    return prefill, time.perf_counter() - start


def _decode(ctx, chunks: list[list[int]], starts: list[int], n_vocab: int) -> list[int]:
    """One llama_decode of every sequence's next tokens; the greedy next token of each."""
    total = sum(len(c) for c in chunks)
    b = ll.llama_batch_init(total, 0, len(chunks))
    i = 0
    for seq, (chunk, start) in enumerate(zip(chunks, starts, strict=True)):
        for j, token in enumerate(chunk):
            b.token[i], b.pos[i], b.n_seq_id[i], b.logits[i] = int(token), start + j, 1, j == len(chunk) - 1
            b.seq_id[i][0] = seq
            i += 1
    b.n_tokens = total
    if ll.llama_decode(ctx, b) != 0:
        raise RuntimeError("llama_decode failed")
    logits = ll.llama_get_logits(ctx)
    array = np.ctypeslib.as_array(ctypes.cast(logits, ctypes.POINTER(ctypes.c_float)), (len(chunks), n_vocab))
    ll.llama_batch_free(b)
    return array.argmax(axis=1).tolist()


if __name__ == "__main__":
    main()
