"""weft's CPU kernels (`kernels.cpp`; `linear.cpp` for the linear layers in float32, bfloat16,
float16 and exact quantized panels, `quant.cpp` packing quantized weights, `qdot.cpp` their int8
products; `decoder.cpp`, a whole decoder stack for single-token rows, with `experts.cpp` for its
mixtures of experts; `prefill_attention.cpp`, attention of multi-token rows over the paged cache;
`rewrite.cpp`, the GGUF types packed as another type's blocks; `file_dot.cpp`, products over a GGUF
file's own blocks), compiled on first use and cached.

Steps of `kernels_available()`, run once per process:
  1. unless `WEFT_NATIVE=0`, look for a build of these exact sources (the cache directory is keyed
     by a hash of the sources, the torch version and the Python version);
  2. if there is none, take the cache directory's build lock (`flock`: the operating system
     releases it when its holder dies, so a build killed mid-way never blocks the next process),
     look again (another process may have built it meanwhile), and compile it with the system C++
     compiler in a fresh `build/` folder (about half a minute, once; a line on stderr says so);
     only a finished build is moved into place, so a killed one is redone, never loaded;
  3. load it, which registers the `torch.ops.weft.*` operators.

Any failure (no compiler, a build error) leaves a warning with the reason and weft runs the same
model code with plain torch operations instead: the kernels are a speed-up, never a requirement.
The kernels run on CPU tensors only; CUDA always takes the torch path.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import platform
import shutil
import sys
import threading
import warnings
from collections.abc import Iterator
from pathlib import Path

import torch

from weft.config import NativeConfig

SOURCES = [
    Path(__file__).with_name(name)
    for name in (
        "kernels.cpp",
        "linear.cpp",
        "quant.cpp",
        "qdot.cpp",
        "decoder.cpp",
        "experts.cpp",
        "prefill_attention.cpp",
        "rewrite.cpp",
        "file_dot.cpp",
    )
]
HEADERS = [
    Path(__file__).with_name(name)
    for name in ("blocks.h", "ops.h", "panels.h", "stack_weights.h", "tiles.h", "vmath.h")
]
_NAME = "weft_kernels"
_CFLAGS = ["-O3", "-fopenmp"]  # OpenMP: at::parallel_for is inline OpenMP code
if platform.machine() in ("x86_64", "AMD64"):
    _CFLAGS.append("-mprefer-vector-width=512")  # loops use all of AVX-512 where the CPU has it
_LDFLAGS = ["-fopenmp"]  # resolves to the libgomp that torch has already loaded
_SANITIZE = ["-fsanitize=address,undefined", "-fno-omit-frame-pointer", "-fno-sanitize-recover=undefined"]


def build_flags(config: NativeConfig) -> tuple[list[str], list[str]]:
    """Compiler and linker flags: optimised, plus the sanitizers when asked for."""
    extra = _SANITIZE if config.sanitize else []
    return [*_CFLAGS, f"-march={config.arch}", *config.extra_cflags, *extra], [*_LDFLAGS, *extra]


_lock = threading.Lock()
_state: dict[str, bool] = {}


def kernels_available() -> bool:
    """Whether the `torch.ops.weft` CPU kernels are loaded (building them on the first call)."""
    if "ok" not in _state:
        with _lock:
            if "ok" not in _state:
                _state["ok"] = _load(NativeConfig.from_env())
    return _state["ok"]


def use_kernels(device: torch.device) -> bool:
    """Whether operations on `device` take the native kernels (CPU only; builds them on first call)."""
    return device.type == "cpu" and kernels_available()


def build_dir(config: NativeConfig) -> Path:
    digest = hashlib.sha256()
    for source in [*SOURCES, *HEADERS]:
        digest.update(source.read_bytes())
    versions = f"{torch.__version__}|{platform.python_version()}|{platform.machine()}|{build_flags(config)}"
    digest.update(versions.encode())
    return config.cache_dir / f"kernels-{digest.hexdigest()[:16]}"


def units(directory: Path, count: int) -> list[Path]:
    """The sources as at most `count` translation units (one per core the build can use): where
    there are fewer cores than sources, unity files under `directory` that include several each, so
    that torch's headers, most of a source's compile time, are parsed once per core."""
    count = max(1, count)
    if count >= len(SOURCES):
        return list(SOURCES)
    paths = []
    for i in range(count):
        unit = directory / f"unit{i}.cpp"
        text = "".join(f'#include "{source}"\n' for source in SOURCES[i::count])
        if not unit.is_file() or unit.read_text() != text:
            unit.write_text(text)
        paths.append(unit)
    return paths


def build_jobs() -> int:
    """How many compilers the build runs at once: MAX_JOBS where set (torch's own build variable),
    else one per core."""
    jobs = os.environ.get("MAX_JOBS", "")
    return int(jobs) if jobs.isdigit() and int(jobs) > 0 else os.cpu_count() or 1


def _load(config: NativeConfig) -> bool:
    if not config.enabled:
        return False
    directory = build_dir(config)
    library = directory / f"{_NAME}.so"
    try:
        if not library.is_file():
            directory.mkdir(parents=True, exist_ok=True)
            with _build_lock(directory):
                if not library.is_file():  # nobody built it while this process waited
                    _build(config, directory, library)  # (which loads it)
                    return True
        torch.ops.load_library(str(library))
        return True
    except Exception as exc:  # any build or load failure means: use the torch path
        warnings.warn(
            f"weft: CPU kernels unavailable, using plain torch operations (slower): {_first_error(exc)}\n"
            f"{_what_to_do()}",
            RuntimeWarning,
            stacklevel=2,
        )
        return False


@contextlib.contextmanager
def _build_lock(directory: Path) -> Iterator[None]:
    """The build lock of `directory`: an exclusive `flock`, which the operating system releases when
    the process holding it exits or is killed (none where `fcntl` is missing: not Linux or macOS)."""
    try:
        import fcntl
    except ImportError:
        yield
        return
    with open(directory / "build.lock", "a") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            print("weft: another process is compiling the CPU kernels; waiting for it ...", file=sys.stderr)
            fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _build(config: NativeConfig, directory: Path, library: Path) -> None:
    """Compile and load the kernels in a fresh `directory/build` (whatever an earlier, killed build
    left there is removed first), then move the finished library to `library`."""
    from torch.utils import cpp_extension

    build = directory / "build"
    shutil.rmtree(build, ignore_errors=True)
    build.mkdir()
    message = "weft: compiling CPU kernels (first use only, about half a minute) ..."
    print(message, file=sys.stderr, flush=True)
    cflags, ldflags = build_flags(config)
    cpp_extension.load(
        name=_NAME,
        sources=[str(unit) for unit in units(build, build_jobs())],
        extra_cflags=cflags,
        extra_ldflags=ldflags,
        build_directory=str(build),
        is_python_module=False,
        verbose=False,
    )
    os.replace(build / f"{_NAME}.so", library)  # atomic: a library in place is a whole one
    shutil.rmtree(build, ignore_errors=True)


def _what_to_do() -> str:
    """The way out of a failed build, by what this machine lacks."""
    missing = [tool for tool in ("c++", "ninja") if shutil.which(tool) is None]
    if missing:
        return f"Install {' and '.join(missing)} to enable them, or set WEFT_NATIVE=0 to skip this."
    return (
        "A C++ compiler and ninja are installed: the build itself failed. Set WEFT_CACHE_DIR to a "
        "fresh folder to rebuild there, or WEFT_NATIVE=0 to skip the kernels."
    )


def _first_error(exc: Exception) -> str:
    """The compiler's first error line from a build log, or the exception's message."""
    lines = str(exc).strip().splitlines()
    errors = [line for line in lines if "error" in line.lower() and not line.startswith(("FAILED", "ninja"))]
    return (errors or lines or [type(exc).__name__])[0]
