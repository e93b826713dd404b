"""Decode tokens/s against batch size, weft and llama.cpp on the same GGUF files, from the log of
the side-by-side runs in docs/benchmarks.md ("== ENGINE FILE" lines, each followed by the JSON
rows of benchmarks/engine_decode.py or benchmarks/llama_cpp_decode.py; a later row for the same
file, engine and batch replaces an earlier one).

    python benchmarks/plot_gguf_decode.py bench.log docs/gguf-decode.png
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

FILES = [
    ("smol-q8_0", "SmolLM2-135M Q8_0"),
    ("smol-q4_k_m", "SmolLM2-135M Q4_K_M"),
    ("l1b-q8_0", "Llama-3.2-1B Q8_0"),
    ("l1b-q4_k_m", "Llama-3.2-1B Q4_K_M"),
]
ENGINES = [("weft", "weft (int8 products)", "o-"), ("llama", "llama.cpp", "s--")]


def read_runs(log: Path) -> dict[tuple[str, str], dict[int, float]]:
    """(file, engine) -> {batch: decode tokens/s}."""
    runs: dict[tuple[str, str], dict[int, float]] = {}
    current = None
    for line in log.read_text().splitlines():
        if line.startswith("== "):
            _, engine, name = line.split(maxsplit=2)
            current = (name, engine)
        elif line.startswith("{") and '"batch"' in line and current is not None:
            row = json.loads(line)
            runs.setdefault(current, {})[row["batch"]] = row["decode_tps"]
    return runs


def main() -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = read_runs(Path(sys.argv[1]))
    fig, axes = plt.subplots(1, len(FILES), figsize=(16, 4))
    for ax, (key, title) in zip(axes, FILES, strict=True):
        for engine, label, style in ENGINES:
            data = runs.get((key, engine), {})
            batches = sorted(data)
            ax.plot(batches, [data[b] for b in batches], style, label=label)
        ax.set_title(title)
        ax.set_xlabel("batch")
        ax.set_xscale("log", base=2)
        ax.set_xticks([1, 8, 32], ["1", "8", "32"])
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("decode tokens/s")
    axes[0].legend()
    fig.suptitle("GGUF decode on 2 Zen 4 cores: weft and llama.cpp on the same files")
    fig.tight_layout()
    fig.savefig(sys.argv[2], dpi=80)


if __name__ == "__main__":
    main()
