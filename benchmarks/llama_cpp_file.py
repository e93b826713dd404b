"""A random-weight model of a real shape as a GGUF file made by llama.cpp's own tools: the shape's
Hugging Face checkpoint (transformers' own class and initialisation, bfloat16, `torch.manual_seed(0)`)
converted by llama.cpp's `convert_hf_to_gguf.py` to float16, then quantized by
`llama_cpp.llama_model_quantize` (the tensor-type mix of llama.cpp's quantize tool).

    python benchmarks/llama_cpp_file.py CONFIG.json OUT.gguf --llama-cpp LLAMA_CPP_DIR [--type q4_k_m]
        [--tokenizer DIR]

LLAMA_CPP_DIR is a llama.cpp source tree (the llama-cpp-python sdist's vendor/llama.cpp carries it):
its convert_hf_to_gguf.py and gguf-py. The vocabulary is SmolLM2's tokenizer (49,152 ids, the one
../shared/data/gguf-families was made with) with placeholder tokens up to the config's size: speed
does not depend on the token strings. Needs llama-cpp-python and transformers beside weft; the
checkpoint and the float16 file are written next to OUT and removed (a 3.8B shape: 7.7 GB each).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

from make_quant_files import FTYPES, quantize

from weft.bench.throughput import SHARED


def write_checkpoint(config: Path, tokenizer: Path, out: Path) -> None:
    """A bfloat16 checkpoint of `config`'s shape with transformers' initial weights, and the tokenizer."""
    import torch
    import transformers

    torch.manual_seed(0)
    cfg = transformers.AutoConfig.from_pretrained(config.parent)
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    model.save_pretrained(out, safe_serialization=True)
    for name in ("tokenizer_config.json", "special_tokens_map.json"):
        shutil.copy(tokenizer / name, out / name)
    padded = padded_tokenizer(tokenizer / "tokenizer.json", cfg.vocab_size)
    (out / "tokenizer.json").write_text(json.dumps(padded))


def padded_tokenizer(path: Path, vocab_size: int) -> dict:
    """The tokenizer with placeholder tokens up to the model's vocabulary (ids no merge reaches, so
    the converter's check of its pre-tokenizer sees the same tokens): Gemma 3's converter cuts the
    embedding to the tokenizer's size, and the output matrix is the real shape's."""
    tokenizer = json.loads(path.read_text())
    used = set(tokenizer["model"]["vocab"].values()) | {t["id"] for t in tokenizer["added_tokens"]}
    for i in range(vocab_size):
        if i not in used:
            tokenizer["model"]["vocab"][f"<placeholder_{i}>"] = i
    return tokenizer


def convert(checkpoint: Path, llama_cpp: Path, out: Path) -> None:
    """llama.cpp's converter, checkpoint -> float16 GGUF."""
    env = {**os.environ, "PYTHONPATH": str(llama_cpp / "gguf-py")}
    command = [sys.executable, str(llama_cpp / "convert_hf_to_gguf.py"), str(checkpoint), "--outtype", "f16"]
    subprocess.run([*command, "--outfile", str(out)], check=True, env=env)


def main() -> None:
    raw = argparse.RawDescriptionHelpFormatter
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=raw)
    parser.add_argument("config", type=Path, help="a config.json of the shape")
    parser.add_argument("out", type=Path)
    parser.add_argument("--llama-cpp", type=Path, required=True, help="llama.cpp's source tree")
    parser.add_argument("--type", default="q4_k_m", choices=sorted(FTYPES))
    parser.add_argument("--tokenizer", type=Path, default=SHARED / "tokenizers" / "smollm2")
    args = parser.parse_args()
    work = args.out.with_suffix(".work")
    checkpoint, f16 = work / "checkpoint", work / "f16.gguf"
    start = time.perf_counter()
    try:
        write_checkpoint(args.config, args.tokenizer, checkpoint)
        print(f"checkpoint written ({time.perf_counter() - start:.0f} s)", flush=True)
        convert(checkpoint, args.llama_cpp, f16)
        shutil.rmtree(checkpoint)
        print(f"converted ({time.perf_counter() - start:.0f} s)", flush=True)
        quantize(f16, args.out, args.type)
        print(f"{args.out}: {args.out.stat().st_size / 1e9:.2f} GB ({time.perf_counter() - start:.0f} s)")
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
