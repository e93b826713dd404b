"""The kernels' other ISA builds: each path this machine's own build does not take is built with its
flags and, where this CPU can run it, the kernels' accuracy tests run against it in child pytest
processes; where it cannot, every source is compiled with the same flags.

`python tests/other_builds.py PATH OUT` checks one build (exit status 0 when it passes); the suite
starts one such job per path at collection (tests/background.py) and
`test_half_precision.test_other_builds_of_the_kernels_pass_the_same_tests` awaits them.
"""

from __future__ import annotations

import os
import platform
import subprocess
import sys
from pathlib import Path

TESTS = Path(__file__).resolve().parent
CHILD_BUILD = "WEFT_TEST_CHILD_BUILD"  # set in the child processes that test another build

# Every ISA path of weft/native: -march and extra flags, the build_info it must report, and the CPU
# flags that running it needs (without them the build is only compiled).
BUILDS = {
    "scalar": ("x86-64", "", "scalar", {"sse2"}),
    "avx2": ("x86-64-v3", "", "avx2", {"avx2", "fma", "f16c"}),
    "avx512": ("skylake-avx512", "", "avx512", {"avx512f", "avx512bw", "avx512vl", "avx512dq"}),
    "avx512_bf16": ("cooperlake", "", "avx512_bf16", {"avx512f", "avx512bw", "avx512vl", "avx512_bf16"}),
}
# What a child runs against another build: every test of the panels, the bfloat16 products and the
# model-level parity of test_half_precision.py, the prefill GEMM's two paths, the other kernels'
# vector paths, the fused decoder stack, the exact quantized panels and the int8 products (vpdpbusd,
# vpmaddubsw on AVX-512BW and AVX2, scalar), in dot panels and in the file's own blocks.
CHILD_TESTS = [
    ("not peak and not other_builds and not torch_half", "test_half_precision.py"),
    ("both_paths", "test_prefill_gemm.py"),
    (
        "gumbel or row_max or row_logprobs or constraint_logmass or top_p_filter or silu or attention"
        " or packed_linear or rms_norm or decoder_stack",
        "test_native.py",
    ),
    ("q8_0", "test_quant.py"),
    ("", "test_qdot.py"),
    ("", "test_quant_types.py"),  # Q2_K's products, Q3_K / IQ4 rewrites
    ("native", "test_sliding_window.py"),  # windows, sinks and soft caps in the attention kernels
    ("attention or written or half_cache or q8", "test_kv_cache_dtype.py"),  # half and Q8_0 caches
    ("packed_linear_rows", "test_moe_rows.py"),  # a row's experts in one grouped product
    ("", "test_file_dot.py"),  # products in the file's own blocks (file_dot.cpp)
]


def is_x86() -> bool:
    return platform.machine() in ("x86_64", "AMD64")


def cpu_flags() -> set[str]:
    """The CPU's feature flags (Linux; empty elsewhere)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def cache_dir(path: str) -> Path:
    """Where the build `path` is kept between sessions: under weft's kernel cache, in a folder keyed
    by the sources and flags (`weft.native.build_dir`), so only changed kernels are built again."""
    from weft.config import NativeConfig

    return NativeConfig.from_env().cache_dir / "other-builds" / path


def command(path: str, out: Path) -> list[str]:
    """The command that checks the build `path`, its files under `out`."""
    return [sys.executable, str(Path(__file__).resolve()), path, str(out)]


def check(path: str, out: Path) -> None:
    """Build `path` under `out` and test it (or compile it only); AssertionError when it fails."""
    arch, cflags, isa, needs = BUILDS[path]
    env = {**os.environ, "CI": "true", CHILD_BUILD: "1", "WEFT_NATIVE_ARCH": arch}
    # MAX_JOBS=1: one translation unit, torch's headers parsed once (the build runs beside the suite);
    # -O2 (after the build's -O3, so it wins): half the compile time (the scalar build on the AVX2
    # EPYC: 62 s of CPU, not 126 s), and the ISA paths it tests are intrinsics, compiled the same
    env |= {"WEFT_NATIVE_CFLAGS": f"{cflags} -O2".strip(), "WEFT_CACHE_DIR": str(out), "MAX_JOBS": "1"}
    if not needs <= cpu_flags():
        compile_only(arch, cflags, out)
        print(f"{path}: compiled (this CPU cannot run it)")
        return
    code = "import weft.native as n, weft.kernels as k; n.kernels_available(); print(k.cpu_isa_path())"
    # a loaded 2-core machine leaves this lowest-priority build little CPU: as long as the job may take
    info = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=1200)
    assert info.returncode == 0 and info.stdout.split() == [isa], info.stdout + info.stderr[-3000:]
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-k", child_selection()]
    cmd += [str(TESTS / test_file) for _, test_file in CHILD_TESTS]
    result = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1200)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    assert " passed" in result.stdout and " skipped" not in result.stdout, result.stdout[-2000:]
    print(f"{path}: {result.stdout.strip().splitlines()[-1]}")


def child_selection() -> str:
    """CHILD_TESTS as one -k expression over their files (one child process, one torch import)."""
    parts = [f"({Path(f).stem} and ({k}))" if k else Path(f).stem for k, f in CHILD_TESTS]
    return " or ".join(parts)


def compile_only(arch: str, cflags: str, out: Path) -> None:
    """Compile every source of a build this CPU cannot run (its flags, no link, no load): as one
    translation unit (torch's headers, parsed once per unit, are half the time; these builds run
    beside the suite, where CPU time, not wall time, is what they cost), without optimization (an
    intrinsic the -march does not enable still fails: always_inline functions are inlined at -O0 too)."""
    from torch.utils.cpp_extension import include_paths

    import weft.native as native
    from weft.config import NativeConfig

    flags, _ = native.build_flags(NativeConfig(True, out, arch=arch, extra_cflags=tuple(cflags.split())))
    flags = ["-O0" if flag == "-O3" else flag for flag in flags]  # the same errors, half the time
    stamp = native.build_dir(NativeConfig(True, out, arch=arch, extra_cflags=tuple(cflags.split())))
    if stamp.with_suffix(".compiled").is_file():  # these sources, these flags: compiled before
        return
    includes = [f"-I{path}" for path in include_paths()]
    (unit,) = native.units(out, 1)
    cmd = ["c++", "-std=c++17", "-fPIC", *flags, *includes, "-c", str(unit), "-o", f"{unit}.o"]
    compiler = subprocess.run(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, timeout=600)
    assert compiler.returncode == 0, compiler.stderr[-3000:]
    stamp.with_suffix(".compiled").touch()


if __name__ == "__main__":
    sys.path.insert(1, str(TESTS.parent))  # weft from this checkout, installed or not
    target, directory = sys.argv[1], Path(sys.argv[2])
    directory.mkdir(parents=True, exist_ok=True)
    check(target, directory)
