"""Decode tokens/s against batch size from the logs of benchmarks/separate_processes.py, one panel a file.

    python benchmarks/plot_separate_processes.py docs/moe-decode.png q30b.log q30b-b1.log goss.log ...

Each log names its file on its first line ("/tmp/moe/q30b.gguf (18.55 GB), prompt 512, ...") and
holds a line per run ("batch 8 round 1 weft: {json}"); a panel shows each engine's best decode
tokens/s per batch size, and where a later log measured a file's batch size again, its runs replace
the earlier log's (a run after a change to weft).
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

RUN = re.compile(r"^batch (\d+) round \d+ (weft|llama\.cpp): (\{.*\})$")
STYLES = {"weft": "o-", "llama.cpp": "s--"}
Runs = dict[str, dict[str, dict[int, float]]]  # file -> engine -> {batch: best decode tokens/s}


def read_logs(paths: list[Path]) -> Runs:
    runs: Runs = {}
    for path in paths:
        lines = path.read_text().splitlines()
        name = lines[0].split(", output")[0].replace(str(Path(lines[0].split(" ")[0]).parent) + "/", "")
        measured: dict[str, dict[int, float]] = {}
        for line in lines[1:]:
            match = RUN.match(line)
            if match:
                batch, engine, row = int(match[1]), match[2], json.loads(match[3])
                best = measured.setdefault(engine, {})
                best[batch] = max(best.get(batch, 0.0), row["decode"])
        for engine, best in measured.items():
            runs.setdefault(name, {}).setdefault(engine, {}).update(best)  # a later log replaces
    return runs


def plot(runs: Runs, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(runs), figsize=(5 * len(runs), 4), squeeze=False)
    for ax, (name, engines) in zip(axes[0], runs.items(), strict=True):
        for engine, best in engines.items():
            batches = sorted(best)
            ax.plot(batches, [best[b] for b in batches], STYLES.get(engine, "x:"), label=engine)
        ax.set_title(name)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("batch size")
        ax.set_ylabel("decode tokens/s")
        ax.set_ylim(bottom=0)
        ax.legend()
    fig.tight_layout()
    fig.savefig(out, dpi=110)


def main() -> None:
    if len(sys.argv) < 3:
        raise SystemExit(__doc__)
    plot(read_logs([Path(p) for p in sys.argv[2:]]), Path(sys.argv[1]))


if __name__ == "__main__":
    main()
