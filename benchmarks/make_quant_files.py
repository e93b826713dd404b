"""GGUF files of every quant type, made by llama.cpp's own quantizer, and llama.cpp's outputs on them.

    python benchmarks/make_quant_files.py OUT_DIR [--config CONFIG.json] [--num-layers N]
        [--types q2_k,q3_k_m,...] [--record REFERENCE.json]

A random float16 file of the shape of `--config` (weft/bench/random_gguf.py; without it, the tiny
Llama of tests/data/quant_types: hidden 256, 2 layers, MLP 512, 1,024 placeholder tokens, weights
normal(0, 0.1), the tied embedding normal(0, 0.6)) is quantized by `llama_cpp.llama_model_quantize`
into each type (`OUT_DIR/<type>.gguf`). With `--record`, llama.cpp's (2 threads, CPU) 16 greedy
tokens from 8 prompts of 24 random ids on each file, and teacher-forced along them each token's
log-softmax and the argmax at each position, as tests/test_quant_files.py reads them.

Needs llama-cpp-python (never a weft dependency; docs/benchmarks.md has the recipe).
"""

from __future__ import annotations

import argparse
import json
import platform
import tempfile
from pathlib import Path

import numpy as np

from weft.bench.random_gguf import write_random_gguf

# llama.cpp's file types (llama_ftype) by the names its quantize tool takes
FTYPES = {
    "q2_k": 10, "q3_k_s": 11, "q3_k_m": 12, "q3_k_l": 13, "q4_k_m": 15, "q5_k_m": 17, "q6_k": 18,
    "iq4_nl": 25, "iq4_xs": 30, "q8_0": 7,
}  # fmt: skip
TINY = {
    "architectures": ["LlamaForCausalLM"],
    "hidden_size": 256,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "intermediate_size": 512,
    "vocab_size": 1024,
    "tie_word_embeddings": True,
    "rope_theta": 100000.0,
    "rms_norm_eps": 1e-5,
    "max_position_embeddings": 2048,
}
TINY_STDS = (0.1, 0.6)  # matrices, embedding: a clear top token, as the files of ../shared/data/gguf


def quantize(source: Path, out: Path, kind: str) -> Path:
    import llama_cpp

    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = FTYPES[kind]
    params.nthread = 2
    if llama_cpp.llama_model_quantize(str(source).encode(), str(out).encode(), params) != 0:
        raise SystemExit(f"llama.cpp could not quantize {source} to {kind}")
    return out


def record(path: Path, prompts: list[list[int]], tokens: int = 16) -> list[dict]:
    """llama.cpp's greedy tokens from each prompt, and teacher-forced along them its log-softmax of
    each token and the argmax at each position."""
    import llama_cpp

    llm = llama_cpp.Llama(str(path), n_ctx=256, n_threads=2, logits_all=True, verbose=False, seed=0)
    runs = []
    for prompt in prompts:
        llm.reset()
        llm.eval(prompt)
        greedy: list[int] = []
        for _ in range(tokens):
            greedy.append(int(np.argmax(llm.scores[llm.n_tokens - 1])))
            llm.eval([greedy[-1]])
        llm.reset()
        llm.eval(prompt + greedy)
        logits = np.asarray(llm.scores[len(prompt) - 1 : len(prompt) - 1 + tokens], dtype=np.float64)
        logprobs = logits - logits.max(axis=1, keepdims=True)
        logprobs -= np.log(np.exp(logprobs).sum(axis=1, keepdims=True))
        runs.append(
            {
                "tokens": greedy,
                "tf_logprobs": [float(logprobs[i, t]) for i, t in enumerate(greedy)],
                "tf_argmax": [int(i) for i in logits.argmax(axis=1)],
            }
        )
    return runs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--config", type=Path, default=None, help="a config.json (default: the tiny Llama)")
    parser.add_argument("--num-layers", type=int, default=None)
    parser.add_argument("--types", default="q2_k,q3_k_m,q5_k_m,q6_k,iq4_nl,iq4_xs")
    parser.add_argument("--record", type=Path, default=None, help="write llama.cpp's outputs here")
    args = parser.parse_args()
    import llama_cpp

    args.out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        config, stds = args.config, (0.02, 0.02)
        if config is None:
            config, stds = Path(tmp) / "config.json", TINY_STDS
            config.write_text(json.dumps(TINY))
        vocab = json.loads(config.read_text())["vocab_size"]
        source = Path(tmp) / "f16.gguf"
        write_random_gguf(config, "f16", source, seed=2026, num_layers=args.num_layers, stds=stds)
        files = {kind: quantize(source, args.out / f"{kind}.gguf", kind) for kind in args.types.split(",")}
    for path in files.values():
        print(f"{path}: {path.stat().st_size / 1e6:.2f} MB")
    if args.record is None:
        return
    rng = np.random.default_rng(2026)
    prompts = [[int(i) for i in rng.integers(2, vocab, 24)] for _ in range(8)]
    reference = {
        "llama_cpp_python": llama_cpp.__version__,
        "cpu": platform.processor() or platform.machine(),
        "threads": 2,
        "prompts": prompts,
        "files": {kind: record(path, prompts) for kind, path in files.items()},
    }
    args.record.write_text(json.dumps(reference) + "\n")


if __name__ == "__main__":
    main()
