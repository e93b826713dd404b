"""weft's teacher-forced prompt logprobs on a GGUF file against llama.cpp's on the same file, and
against weft's own with a float16 KV cache (how far half-precision rounding alone moves the model:
the scale to read the first difference on).

    python benchmarks/prompt_agreement.py FILE.gguf [--tokens 40]

Prints the largest and the mean |difference| over the prompt's positions, for each pair. A random
model's logprobs sit near -log(vocabulary), and a deep random stack carries a rounding difference
forward further than a trained one does; so the float16-KV pair is the yardstick for the other.
Needs llama-cpp-python beside weft (docs/benchmarks.md has the recipe).
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
import torch


def llama_cpp_logprobs(path: Path, prompt: list[int]) -> np.ndarray:
    """llama.cpp's log-probability of each prompt token after the ones before it (2 threads)."""
    import llama_cpp

    context = max(256, 2 * len(prompt))
    llm = llama_cpp.Llama(str(path), n_ctx=context, n_threads=2, logits_all=True, verbose=False)
    llm.eval(prompt)
    logits = torch.from_numpy(np.asarray(llm.scores[: len(prompt) - 1], dtype=np.float64))
    logprobs = torch.log_softmax(logits, dim=-1).numpy()
    return logprobs[np.arange(len(prompt) - 1), prompt[1:]]


def weft_logprobs(path: Path, prompt: list[int], kv_cache_dtype: str) -> np.ndarray:
    """weft's prompt logprobs of the same tokens."""
    from weft import LLM, SamplingParams

    context = max(512, 2 * len(prompt))
    llm = LLM(str(path), show_progress=False, max_model_len=context, kv_cache_dtype=kv_cache_dtype)
    params = SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=0, ignore_eos=True)
    (out,) = llm.generate([prompt], params, use_tqdm=False)
    assert out.prompt_logprobs is not None
    return np.array([position[prompt[i]].logprob for i, position in enumerate(out.prompt_logprobs) if i > 0])


def main() -> None:
    raw = argparse.RawDescriptionHelpFormatter
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=raw)
    parser.add_argument("file", type=Path)
    parser.add_argument("--tokens", type=int, default=40)
    args = parser.parse_args()
    prompt = [(i * 7919) % 40000 + 100 for i in range(args.tokens)]  # ids every vocabulary here has
    ours = weft_logprobs(args.file, prompt, "auto")
    pairs = {
        "llama.cpp": llama_cpp_logprobs(args.file, prompt),
        "weft, float16 KV": weft_logprobs(args.file, prompt, "float16"),
    }
    print(f"{args.file.name}: weft's logprobs {ours.min():.2f} .. {ours.max():.2f}")
    for name, theirs in pairs.items():
        diff = np.abs(ours - theirs)
        print(f"  against {name}: max |diff| {diff.max():.4f}, mean {diff.mean():.4f}")


if __name__ == "__main__":
    main()
