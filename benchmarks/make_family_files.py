"""Make tests/data/families: tiny random checkpoints (transformers) of the families
../shared/data/gguf-families has none of, converted to float16 GGUF files by llama.cpp's own
converter, with llama.cpp's greedy tokens and teacher-forced logprobs on each (the format of
../shared/data/gguf-families/llama_cpp_reference.json, in llama_cpp.json). Phi-3's file, which
llama.cpp 0.3.36 converts but will not load over this tokenizer ("error loading model vocabulary:
unordered_map::at"), has transformers' on the checkpoint it was converted from instead
(transformers.json).

    python benchmarks/make_qwen2moe_file.py LLAMA_CPP_DIR [OUT_DIR]

LLAMA_CPP_DIR is a llama.cpp source tree (the llama-cpp-python sdist's vendor/llama.cpp carries
it): its convert_hf_to_gguf.py and gguf-py. Needs llama-cpp-python and transformers beside weft.
The checkpoint is the tests' tiny one (tests/checkpoints.py: hidden 64, 4 heads over 2 KV heads,
a byte-level BPE of 384 ids) with 4 layers of 8 experts, 2 per token, weights not normalised, and
a shared expert of 48 columns, and an output matrix of its own (llama.cpp's qwen2moe ties none).
The converter knows no hash of that tokenizer's pre-tokenizer, so it is told "gpt-2" (the ids are
what the tests compare, never text).
"""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
NUM_NEW = 16
FAMILIES = {  # file -> the tests' checkpoint arch
    "qwen2moe-f16": "qwen2moe",  # 8 experts, 2 per token, not normalised, a shared expert of 48 columns
    "olmo2-f16": "olmo2",  # norms after each branch, q/k norms over all heads
}
# files whose reference is transformers' (the checkpoint in float32), not llama.cpp's
TRANSFORMERS_REFERENCE = {
    "phi3-f16": "phi3",  # fused q|k|v and gate|up, 3/4 of each head rotating, LongRoPE's factors
}


def checkpoint(out: Path, arch: str) -> Path:
    """The tests' tiny checkpoint, its matrices scaled back to transformers' own initial spread
    (0.02) and its final norm set to 8 so that the logits are spread, as ../shared/data's family
    files are: float16 activations (llama.cpp's) then stay as close to float32 as there."""
    import torch
    import transformers

    sys.path.insert(0, str(ROOT / "tests"))
    from checkpoints import build_checkpoint

    build_checkpoint(out, arch, seed=99, num_hidden_layers=4, tie_word_embeddings=False)
    model = transformers.AutoModelForCausalLM.from_pretrained(out)
    with torch.no_grad():
        for param in model.parameters():
            if param.dim() >= 2:
                param.mul_(0.1)
        model.model.norm.weight.fill_(8.0)
    model.save_pretrained(out, safe_serialization=True)
    return out


def convert(llama_cpp: Path, model: Path, out: Path) -> None:
    """llama.cpp's convert_hf_to_gguf.py, run here with its own gguf-py."""
    if str(llama_cpp) not in sys.path:
        sys.path[:0] = [str(llama_cpp / "gguf-py"), str(llama_cpp)]
        for name in [m for m in sys.modules if m == "gguf" or m.startswith("gguf.")]:
            del sys.modules[name]  # (the installed gguf may be older than the converter's)
    import convert_hf_to_gguf as converter
    from conversion import base

    base.TextModel.get_vocab_base_pre = lambda self, tokenizer: "gpt-2"
    sys.argv = ["convert_hf_to_gguf.py", str(model), "--outtype", "f16", "--outfile", str(out)]
    converter.main()


def record(path: Path, prompts: list[list[int]]) -> list[dict]:
    """llama.cpp's greedy tokens after each prompt and their logprobs."""
    import llama_cpp

    llm = llama_cpp.Llama(str(path), n_ctx=256, n_threads=2, logits_all=True, verbose=False)
    files = []
    for prompt in prompts:
        llm.reset()
        llm.eval(prompt)
        tokens, logprobs = [], []
        for _ in range(NUM_NEW):
            row = np.array(llm.scores[llm.n_tokens - 1], dtype=np.float64)
            row = row - row.max() - np.log(np.exp(row - row.max()).sum())
            token = int(row.argmax())
            tokens.append(token)
            logprobs.append(float(row[token]))
            llm.eval([token])
        files.append({"tokens": tokens, "tf_logprobs": logprobs})
    return files


def record_transformers(model: Path, prompts: list[list[int]]) -> list[dict]:
    """transformers' greedy tokens after each prompt (each a forward over everything before it, past
    any end-of-sequence token) and their teacher-forced logprobs (one forward over the prompt and
    its tokens), the checkpoint in float32."""
    import torch
    import transformers

    reference = transformers.AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
    runs = []
    for prompt in prompts:
        ids = torch.tensor(prompt)
        with torch.no_grad():
            for _ in range(NUM_NEW):
                ids = torch.cat([ids, reference(ids[None]).logits[0, -1].argmax().view(1)])
            tokens = ids[len(prompt) :].tolist()
            logits = reference(ids[None]).logits[0, len(prompt) - 1 : -1].float().log_softmax(-1)
        logprobs = [float(logits[i, token]) for i, token in enumerate(tokens)]
        runs.append({"tokens": tokens, "tf_logprobs": logprobs})
    return runs


def gpt2_vocabulary(model: Path) -> None:
    """Have the converter write the checkpoint's byte-level BPE as such (its Phi-3 class reads a
    SentencePiece model unless the tokenizer says it is GPT-2's)."""
    config_file = model / "tokenizer_config.json"
    config = json.loads(config_file.read_text()) if config_file.is_file() else {}
    config_file.write_text(json.dumps({**config, "tokenizer_class": "GPT2Tokenizer"}))


def main() -> None:
    llama_cpp_dir = Path(sys.argv[1])
    out = Path(sys.argv[2]) if len(sys.argv) > 2 else ROOT / "tests" / "data" / "families"
    out.mkdir(parents=True, exist_ok=True)
    rng = random.Random(7)  # six prompts of token ids: five of 80, one of 5
    prompts = [[rng.randrange(3, 384) for _ in range(80)] for _ in range(5)] + [[5, 17, 42, 99, 100]]
    reference: dict = {"prompts": prompts, "n_new": NUM_NEW, "files": {}}
    for name, arch in FAMILIES.items():
        model = checkpoint(out / f"hf-{arch}", arch)
        convert(llama_cpp_dir, model, out / f"{name}.gguf")
        reference["files"][name] = record(out / f"{name}.gguf", prompts)
    (out / "llama_cpp.json").write_text(json.dumps(reference))
    others: dict = {"prompts": prompts, "n_new": NUM_NEW, "files": {}}
    for name, arch in TRANSFORMERS_REFERENCE.items():
        model = checkpoint(out / f"hf-{arch}", arch)
        gpt2_vocabulary(model)
        convert(llama_cpp_dir, model, out / f"{name}.gguf")
        others["files"][name] = record_transformers(model, prompts)
    (out / "transformers.json").write_text(json.dumps(others))
    print(f"wrote {out}; remove its hf-* folders before committing")


if __name__ == "__main__":
    main()
