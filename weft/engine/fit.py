"""Whether a checkpoint can fit this machine's memory, said before loading starts, and what a load
took, said after.

On CPU weft packs every matrix into panels of its own (weft/model/loader.py): at least the
checkpoint's bytes of memory (a quantized file's panels hold about its bytes, float ones as many or,
widened to float32, more), beside the KV cache and the runtime. A file larger than the memory the
kernel reports available (`MemAvailable`, which counts the page cache it can reclaim) cannot run,
and loading it would end, minutes later, in the out-of-memory killer: `check_fits` refuses it first
and says what to do. Linux only (elsewhere nothing is checked).
"""

from __future__ import annotations

import sys
from pathlib import Path

from weft.config import ConfigError

MEMINFO = Path("/proc/meminfo")
STATUS = Path("/proc/self/status")


def _kilobytes(path: Path, key: str) -> int | None:
    """A "Key:  N kB" line of a /proc file, in bytes (None where there is no such file or line)."""
    try:
        for line in path.read_text().splitlines():
            name, _, value = line.partition(":")
            if name == key:
                return int(value.split()[0]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def mem_available() -> int | None:
    return _kilobytes(MEMINFO, "MemAvailable")


def resident_bytes() -> int | None:
    return _kilobytes(STATUS, "VmRSS")


def checkpoint_bytes(path: Path) -> int:
    """The bytes of a GGUF file, or of a checkpoint directory's safetensors files."""
    if path.is_dir():
        return sum(f.stat().st_size for f in path.glob("*.safetensors"))
    return path.stat().st_size


def check_fits(path: Path, in_file: int = 0) -> None:
    """Refuse, before reading a tensor, a checkpoint larger than the memory available to run it
    (less `in_file`, the bytes of experts multiplied from the file's pages, which the page cache
    holds and gives back as it must)."""
    available = mem_available()
    size = checkpoint_bytes(path) - in_file
    if available is not None and size > available:
        kept = f" beside the {in_file / 1e9:.1f} GB of experts read from the file" if in_file else ""
        raise ConfigError(
            f"{path} holds {size / 1e9:.1f} GB of weights{kept}, and weft needs at least that much memory to "
            f"run it on CPU; this machine has {available / 1e9:.1f} GB available (MemAvailable). Close other "
            "programs, or use a smaller quantization of the model (e.g. Q4_K_M in place of Q8_0)"
        )


def experts_in_file(choice: str, path: Path, applies: bool) -> bool:
    """Whether a GGUF file's mixture of experts keeps its experts in the file's blocks
    (`expert_weights`): "file" always where it `applies` (a GGUF file with experts, on CPU, with int8
    products), "panels" never, "auto" where the file and `FILE_HEADROOM` do not fit the memory
    available: its panels would need as much again (docs/benchmarks.md, "Experts from the file's
    pages")."""
    if choice not in ("auto", "panels", "file"):
        raise ConfigError(f"expert_weights must be auto, panels or file, got {choice!r}")
    if choice == "panels" or not applies:
        return False
    available = mem_available()
    return choice == "file" or (available is not None and checkpoint_bytes(path) + FILE_HEADROOM > available)


FILE_HEADROOM = 1_500_000_000  # bytes beside a file's panels: the runtime, the KV cache, a step's activations


def _size(num_bytes: int) -> str:
    return f"{num_bytes / 1e9:.2f} GB" if num_bytes >= 1e9 else f"{num_bytes / 1e6:.0f} MB"


def report_load(path: Path, seconds: float, in_file: int = 0) -> None:
    """One line on stderr: what was loaded, from how many bytes, how long it took, what it holds
    (and `in_file`, the bytes of experts it multiplies from the file's pages)."""
    resident = resident_bytes()
    held = f", {_size(resident)} resident" if resident is not None else ""
    mapped = f", {_size(in_file)} of experts read from the file's pages" if in_file else ""
    print(
        f"weft: loaded {path.name} ({_size(checkpoint_bytes(path))}) in {seconds:.1f} s{held}{mapped}",
        file=sys.stderr,
    )
