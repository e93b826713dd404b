"""Record llama.cpp's greedy continuations of prompts on a GGUF file, for weft's tests to compare with.

    python benchmarks/record_llama_cpp.py FILE.gguf OUT.json [--tokens 32] [--threads 2]

Needs llama-cpp-python (never a weft dependency; docs/benchmarks.md has the recipe) and weft in
the same environment: the prompts are tokenized by weft (plain texts, and chat conversations
rendered by the file's own chat template), so the test feeds weft exactly the ids llama.cpp saw.
For each prompt: llama.cpp's greedy tokens (`tokens`), each token's log-softmax under llama.cpp's
logits (`logprobs`), and its top-2 logprob margin (`margins`: where the two best tokens are close,
any two implementations may part).
"""

from __future__ import annotations

import argparse
import json
import platform
from pathlib import Path

import numpy as np

PLAIN = [
    "The capital of France is",
    "def fibonacci(n):\n",
    "Once upon a time, in a small village by the sea,",
    "The three primary colors are",
]
CHATS = [
    "What is the capital of Japan?",
    "Write a haiku about autumn leaves.",
    "Explain what a prime number is in one sentence.",
    "List three fruits that are red.",
]


def prompt_ids(path: Path) -> list[tuple[str, list[int]]]:
    from weft.model.gguf_checkpoint import GgufCheckpoint
    from weft.tokenizer import Tokenizer

    tokenizer = Tokenizer.from_gguf(GgufCheckpoint(path).metadata, str(path))
    prompts = [(text, tokenizer.encode(text)) for text in PLAIN]
    for question in CHATS:
        text = tokenizer.apply_chat_template([{"role": "user", "content": question}], True)
        prompts.append((text, tokenizer.encode(text, add_special_tokens=False)))
    return prompts


def log_softmax(logits: np.ndarray) -> np.ndarray:
    shifted = logits.astype(np.float64) - logits.max()
    return shifted - np.log(np.exp(shifted).sum())


def greedy(llm, ids: list[int], count: int) -> dict[str, list]:
    llm.reset()
    llm.eval(ids)
    tokens, logprobs, margins = [], [], []
    for _ in range(count):
        lp = log_softmax(np.array(llm.scores[llm.n_tokens - 1]))
        top2 = np.argsort(lp)[-2:]
        token = int(top2[1])
        tokens.append(token)
        logprobs.append(float(lp[token]))
        margins.append(float(lp[top2[1]] - lp[top2[0]]))
        llm.eval([token])
    return {"tokens": tokens, "logprobs": logprobs, "margins": margins}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("file", type=Path)
    parser.add_argument("out", type=Path)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    import llama_cpp

    llm = llama_cpp.Llama(
        str(args.file), n_ctx=512, n_threads=args.threads, logits_all=True, verbose=False, seed=0
    )
    runs = []
    for text, ids in prompt_ids(args.file):
        runs.append({"prompt": text, "ids": ids, **greedy(llm, ids, args.tokens)})
        print(repr(text[-40:]), "->", repr(llm.detokenize(runs[-1]["tokens"]).decode(errors="replace")))
    record = {
        "file": args.file.name,
        "llama_cpp_python": llama_cpp.__version__,
        "cpu": platform.processor() or platform.machine(),
        "threads": args.threads,
        "runs": runs,
    }
    args.out.write_text(json.dumps(record, indent=1) + "\n")


if __name__ == "__main__":
    main()
