"""Decode tokens/s against batch size, weft and llama.cpp on the same GGUF files, one panel a file.

From the `--json` results of `weft bench throughput --model FILE.gguf` (weft and llama.cpp measured
alternating in one process), the panel titled by the file's name:

    python benchmarks/plot_gguf_decode.py docs/gguf-decode-avx2.png smol-q8_0.json smol-q4_k_m.json ...

or from the log of the earlier runs of one engine at a time ("== ENGINE FILE" lines, each followed
by the JSON rows of benchmarks/engine_decode.py or benchmarks/llama_cpp_decode.py; a later row for
the same file, engine and batch replaces an earlier one), the files of FILES:

    python benchmarks/plot_gguf_decode.py docs/gguf-decode.png bench.log
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
Panel = tuple[str, dict[str, dict[int, float]]]  # title, engine -> {batch: decode tokens/s}


def read_log(log: Path) -> list[Panel]:
    runs: dict[str, dict[str, dict[int, float]]] = {}
    current = None
    for line in log.read_text().splitlines():
        if line.startswith("== "):
            _, engine, name = line.split(maxsplit=2)
            current = (name, engine)
        elif line.startswith("{") and '"batch"' in line and current is not None:
            row = json.loads(line)
            runs.setdefault(current[0], {}).setdefault(current[1], {})[row["batch"]] = row["decode_tps"]
    return [(title, runs.get(key, {})) for key, title in FILES]


def read_results(path: Path) -> Panel:
    """The first dtype's run of a `weft bench throughput --json` file."""
    result = json.loads(path.read_text())
    run = next(iter(result["runs"].values()))
    rows = run["results"]
    engines = {"weft": {r["batch"]: r["weft_decode_tps"] for r in rows}}
    if run.get("reference") == "llama.cpp":
        engines["llama"] = {r["batch"]: r["ref_decode_tps"] for r in rows}
    return Path(result["model"]).stem, engines


def main() -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out, inputs = Path(sys.argv[1]), [Path(a) for a in sys.argv[2:]]
    if len(inputs) == 1 and inputs[0].suffix != ".json":
        panels, machine = read_log(inputs[0]), "2 Zen 4 cores"
    else:
        panels, machine = [read_results(p) for p in inputs], "2 CPU cores"
    fig, axes = plt.subplots(1, len(panels), figsize=(4 * len(panels), 4), squeeze=False)
    for ax, (title, engines) in zip(axes[0], panels, strict=True):
        for engine, label, style in ENGINES:
            data = engines.get(engine, {})
            batches = sorted(data)
            ax.plot(batches, [data[b] for b in batches], style, label=label)
        every = sorted({b for data in engines.values() for b in data})
        ax.set_title(title)
        ax.set_xlabel("batch")
        ax.set_xscale("log", base=2)
        ax.set_xticks(every, [str(b) for b in every])
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("decode tokens/s")
    axes[0][0].legend()
    fig.suptitle(f"GGUF decode on {machine}: weft and llama.cpp on the same files")
    fig.tight_layout()
    fig.savefig(out, dpi=80)


if __name__ == "__main__":
    main()
