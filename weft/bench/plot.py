"""Plots of benchmark results (matplotlib, from the `bench` extra)."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def plot_decode(runs: dict[str, Any], path: Path, title: str) -> None:
    """Decode tokens/s against batch size, one line per dtype for weft (and a dashed one for the
    reference engine where it was measured). runs: dtype -> {"reference": name, "results": [row,
    ...]} as `weft bench throughput` builds them."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise SystemExit("--plot needs matplotlib: pip install 'weft[bench]'") from None
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for index, (dtype, run) in enumerate(runs.items()):
        rows = run["results"]
        batches = [r["batch"] for r in rows]
        color = f"C{index}"
        ax.plot(batches, [r["weft_decode_tps"] for r in rows], "o-", color=color, label=f"weft {dtype}")
        if all("ref_decode_tps" in r for r in rows):
            ref = [r["ref_decode_tps"] for r in rows]
            ax.plot(batches, ref, "s--", color=color, alpha=0.6, label=f"{run['reference']} {dtype}")
    ax.set_xscale("log", base=2)
    all_batches = sorted({r["batch"] for run in runs.values() for r in run["results"]})
    ax.set_xticks(all_batches, [str(b) for b in all_batches])
    ax.set_xlabel("batch size (sequences decoded together)")
    ax.set_ylabel("decode tokens/s")
    ax.set_title(f"Decode throughput: {title}")
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
