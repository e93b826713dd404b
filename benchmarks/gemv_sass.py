"""What weft's decode kernels over GGUF blocks cost in instructions, measured without a GPU: each is
compiled for an sm_90 GPU (H100, H200) by Triton's own compiler and ptxas (they ship in Triton's
wheel), and its SASS is read with cuobjdump. Printed per kernel, kind and tile: registers a thread,
the instructions of the loop over 256-feature chunks, those per weight (the loop's instructions
over the weights a thread handles in one pass), its `dp4a`s, and its most frequent instructions.

    python benchmarks/gemv_sass.py [--kinds q4_k,q6_k] [--tiles 8x1,16x1,32x4]

At batch 1 an H200 streams 4.8 TB/s: 8.5e12 Q4_K weights a second (4.5 bits each), while its 132
multiprocessors issue about 3.3e13 warp-lane instructions a second, so a kernel that spends more
than about four instructions a Q4_K weight is bound by its instructions, not by memory."""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import tempfile
from collections import Counter
from pathlib import Path

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from weft.cuda import block_gemv, block_gemv_q8

BIN = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
# the integer arguments Triton specializes as multiples of 16 in practice (pointers, widths, strides)
ALIGNED = {"x_ptr", "w_ptr", "out_ptr", "num_out", "stride_x", "row_bytes", "stride_out"}


def compile_sm90(kernel: triton.JITFunction, signature: dict[str, str], constants: dict[str, object],
                 warps: int) -> bytes:  # fmt: skip
    """The cubin of `kernel` for sm_90 (no GPU needed)."""
    names = list(signature)
    attrs = {(names.index(a),): [["tt.divisibility", 16]] for a in ALIGNED if a in names}
    for name in constants:
        signature[name] = "constexpr"
    source = ASTSource(fn=kernel, signature=signature, constexprs=constants, attrs=attrs)
    compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": warps})
    return compiled.asm["cubin"]


def sass_loop(cubin: bytes) -> tuple[int, list[str]]:
    """(registers a thread, the instructions of the longest loop: a backward branch's body)."""
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
        f.write(cubin)
    try:
        usage, sass = (
            subprocess.run([BIN / "cuobjdump", flag, f.name], capture_output=True, text=True).stdout
            for flag in ("-res-usage", "-sass")
        )
    finally:
        os.unlink(f.name)
    regs = int(re.search(r"REG:(\d+)", usage).group(1))  # type: ignore[union-attr]
    lines = [(int(m[1], 16), m[2]) for m in re.finditer(r"/\*([0-9a-f]{4,})\*/\s+([^;]*);", sass)]
    loops = []
    for addr, text in lines:
        branch = re.search(r"\bBRA\b.*?0x([0-9a-f]+)", text)
        if branch and int(branch[1], 16) < addr:
            loops.append([t for a, t in lines if int(branch[1], 16) <= a <= addr])
    return regs, max(loops, key=len, default=[])


def opcode(instruction: str) -> str:
    return re.sub(r"^@!?U?P\w+\s+", "", instruction).split()[0].split(".")[0]


def measure(kernel_name: str, kind: str, block_n: int, warps: int, split: int = 1) -> str:
    signature = {
        "x_ptr": "*bf16",
        "w_ptr": "*u8",
        "out_ptr": "*bf16",
        "sums_ptr": "*fp32",
        "counts_ptr": "*i32",
    }
    signature |= {"num_out": "i32", "num_chunks": "i32"}
    if kernel_name == "int8":
        code, groups, words = block_gemv_q8.Q8_PLANES[kind]
        signature |= {"num_blocks": "i32", "stride_x": "i32", "row_bytes": "i32", "stride_out": "i32"}
        constants = {
            "KIND": code,
            "G": groups,
            "Q": words,
            "BLOCK_N": block_n,
            "COMPILED": True,
            "SPLIT": split,
        }
        kernel = block_gemv_q8._gemv_q8_kernel
    else:
        code, groups, width = block_gemv.PLANES[kind]
        signature |= {"num_blocks": "i32", "stride_x": "i32", "row_bytes": "i32", "stride_out": "i32"}
        constants = {"KIND": code, "G": groups, "W": width, "BLOCK_N": block_n, "FMA": True}
        kernel = block_gemv._gemv_kernel
    regs, loop = sass_loop(compile_sm90(kernel, signature, constants | {"SPLIT": split}, warps))
    per_thread = block_n * 256 / (32 * warps)  # weights a thread handles in one chunk
    counts = Counter(map(opcode, loop))
    common = ", ".join(f"{op} {n}" for op, n in counts.most_common(6))
    return (
        f"| {kernel_name} | {kind} | {block_n} x {warps}, split {split} | {regs} | {len(loop)} | "
        f"{len(loop) / per_thread:.2f} | {counts['IDP']} | {common} |"
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--kinds", default="q4_k,q5_k,q6_k,q8_0,q4_0,q2_k,iq4_xs")
    p.add_argument("--tiles", default="8x1,16x1,32x4", help="BLOCK_N x num_warps, comma-separated")
    p.add_argument("--split", type=int, default=1, help="programs a column tile (split-K)")
    args = p.parse_args(argv)
    columns = ["kernel", "kind", "tile (columns x warps)", "registers", "loop instructions", "a weight"]
    columns += ["dp4a (IDP)", "most frequent"]
    print("| " + " | ".join(columns) + " |")
    print("|---|---|---|---:|---:|---:|---:|---|")
    for kind in args.kinds.split(","):
        for kernel_name in ("float", "int8") if kind in block_gemv_q8.Q8_PLANES else ("float",):
            for tile in args.tiles.split(","):
                block_n, warps = (int(v) for v in tile.split("x"))
                print(measure(kernel_name, kind, block_n, warps, args.split), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
