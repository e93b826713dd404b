"""benchmarks/step_profile.py profiles decode steps and groups their kernels (on CPU: the operators),
for a checkpoint of a config's shape and for a GGUF file of random blocks."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "step_profile.py"


def _script():
    spec = importlib.util.spec_from_file_location("step_profile", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("gguf", [None, "q8_0"])
def test_step_profile_prints_each_batch_with_its_groups(tiny_llama, capsys, gguf):
    args = ["--config", str(tiny_llama / "config.json"), "--device", "cpu", "--dtype", "float32"]
    args += ["--batch-sizes", "1,3", "--steps", "3", "--prompt-len", "8", "--logprobs", "0,5"]
    if gguf is not None:
        args += ["--gguf-type", gguf]
    assert _script().main(args) == 0
    out = capsys.readouterr().out
    head = r"^batch (\d+)(?:, top-5 logprobs)?: ([\d.]+) ms a step \(wall\), ([\d.]+) ms of kernels"
    heads = re.findall(head, out, re.M)
    assert [int(b) for b, _, _ in heads] == [1, 1, 3, 3], out
    assert out.count("top-5 logprobs:") == 2, out
    assert all(float(wall) > 0 and float(busy) > 0 for _, wall, busy in heads), out
    for table in out.split("\nbatch ")[1:]:  # each batch's groups: their shares add up to the whole
        shares = re.findall(r"^\| [^|]+ \| [\d.]+ \| [\d.]+ \| ([\d.]+)% \|$", table, re.M)
        assert shares and abs(sum(float(s) for s in shares) - 100) < 0.5, table


def test_kernel_names_fall_into_their_groups():
    script = _script()
    assert script.group_of("void gemv2T_kernel_val<int, int, __nv_bfloat16>") == "matrix products"
    assert script.group_of("_quantized_linear_kernel") == "matrix products"
    assert script.group_of("_decode_split_kernel") == "attention"
    assert script.group_of("_rope_write_kv_kernel") == "rotary + KV write"
    assert script.group_of("_rms_norm_kernel") == "norms"
    assert script.group_of("_silu_mul_kernel") == "activation"
    assert script.group_of("Memcpy HtoD (Pinned -> Device)") == "copies"
    assert script.group_of("something_else") == "other"
