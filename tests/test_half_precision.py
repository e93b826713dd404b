"""Half-precision weights on CPU: weft's panel kernel widens bfloat16 and float16 weights in
registers (float32 activations and accumulation), so a model loaded in half precision computes
exactly what a float32 load of the same checkpoint computes, at half the bytes read per step."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import weft.native as native
from weft import LLM, SamplingParams
from weft.config import resolve_dtype
from weft.model.layers import WeightLayout

HALF = [torch.bfloat16, torch.float16]
VOCAB = 384  # the tiny checkpoints' vocabulary
TORCH_HALF_ERROR = {"float16": 1e-2, "bfloat16": 1.5e-1}


@pytest.fixture(scope="module", autouse=True)
def kernels():
    if not native.kernels_available():
        if os.environ.get("CI"):
            pytest.fail("the CPU kernels must build in CI (g++ and ninja are expected there)")
        pytest.skip("weft's CPU kernels are off (WEFT_NATIVE=0) or could not be built here")


def bf16_dot_build() -> bool:
    """Whether this build multiplies bfloat16 weights with vdpbf16ps (or its emulation), rounding x
    to bfloat16, rather than widening the weights."""
    return "bf16" in torch.ops.weft.build_info()


@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize("rows", [*range(1, 14), 16, 25, 40])
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("in_features", [45, 64])
def test_half_precision_panels_match_f_linear_in_float32(dtype, rows, bias, in_features):
    """Every tile height (1-12 rows, and runs of tiles), odd sizes (a last panel of 13 columns, an
    odd number of input features), against F.linear in float32 on the very same half-precision
    weights (and, on the bfloat16 dot-product path, on x rounded to bfloat16 as that path does)."""
    gen = torch.Generator().manual_seed(rows)
    out_features = 77
    weight = torch.randn(out_features, in_features, generator=gen).to(dtype)
    b = torch.randn(out_features, generator=gen) if bias else None
    x = torch.randn(rows, in_features, generator=gen)
    panels = torch.ops.weft.pack_linear_weight(weight)
    rounded = dtype == torch.bfloat16 and in_features % 2  # bfloat16 panels hold rows in pairs
    assert panels.dtype == dtype and panels.shape == (3, in_features + rounded, 32)
    out = torch.ops.weft.packed_linear(x, panels, b, out_features)
    x_ref = x.bfloat16().float() if dtype == torch.bfloat16 and bf16_dot_build() else x
    expected = torch.nn.functional.linear(x_ref, weight.float(), b)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


def test_panel_layouts():
    """bfloat16 panels hold input features in pairs (feature 2i in the low half of the 32-bit word
    of its column, 2i + 1 in the high half), the layout both bfloat16 paths read; float16 and
    float32 panels are [K, 32] columns."""
    weight = torch.arange(64 * 3, dtype=torch.float32).view(64, 3)  # exact in bfloat16 and float16
    panels = torch.ops.weft.pack_linear_weight(weight.bfloat16())  # [2, 4, 32]: 3 features + a zero
    pairs = panels.view(2, 2, 32, 2)  # [panel, pair, column, half]
    for c in range(32):
        assert pairs[1, 0, c].tolist() == [weight[32 + c, 0], weight[32 + c, 1]]
        assert pairs[1, 1, c].tolist() == [weight[32 + c, 2], 0.0]
    assert torch.equal(torch.ops.weft.pack_linear_weight(weight.half())[0].t(), weight[:32].half())
    ids = torch.tensor([0, 33, 63])
    for table in (weight, weight.bfloat16(), weight.half()):
        lookup = torch.ops.weft.embedding_from_panels(ids, torch.ops.weft.pack_linear_weight(table), 64, 3)
        assert torch.equal(lookup, weight[ids])


def test_half_precision_kernel_rejects_half_precision_activations():
    panels = torch.ops.weft.pack_linear_weight(torch.randn(32, 8).bfloat16())
    with pytest.raises(RuntimeError, match="x must be a float32"):
        torch.ops.weft.packed_linear(torch.randn(2, 8).bfloat16(), panels, None, 32)
    with pytest.raises(RuntimeError, match="bias must be a contiguous float32"):
        torch.ops.weft.packed_linear(torch.randn(2, 8), panels, torch.randn(32).bfloat16(), 32)


@pytest.mark.parametrize(
    ("arch", "cflags", "isa"),
    [
        ("x86-64-v3", "", ["avx2", "f16c", "fma"]),  # no AVX-512: the widening paths on 256-bit vectors
        ("native", "-DWEFT_EMULATE_BF16_DOT", None),  # the AVX512_BF16 path, its arithmetic emulated
    ],
    ids=["avx2", "bf16-dot"],
)
def test_other_builds_of_the_kernels_pass_the_same_tests(tmp_path, arch, cflags, isa):
    """The paths this machine's build does not take: build them and run this file's kernel tests
    against them in a child process."""
    if os.uname().machine not in ("x86_64", "AMD64"):
        pytest.skip("these are x86 builds")
    if cflags and bf16_dot_build():
        pytest.skip("this machine's own build already takes the AVX512_BF16 path, tested above")
    env = {
        **os.environ,
        "CI": "true",
        "WEFT_NATIVE_ARCH": arch,
        "WEFT_NATIVE_CFLAGS": cflags,
        "WEFT_CACHE_DIR": str(tmp_path),
    }
    code = "import torch, weft.native as n; assert n.kernels_available(); print(torch.ops.weft.build_info())"
    info = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)
    assert info.returncode == 0, info.stderr[-3000:]
    if isa is not None:
        assert info.stdout.split() == isa, info.stdout
    else:
        assert "bf16_dot_emulated" in info.stdout.split(), info.stdout
    selections = [("panel", str(Path(__file__)))]
    if isa is not None:  # the other kernels' AVX2 paths: SiLU, attention, linear, sampling
        selections.append(
            (
                "gumbel or row_logprobs or top_p_filter or silu or attention or packed_linear",
                str(Path(__file__).with_name("test_native.py")),
            )
        )
    for selection, test_file in selections:
        cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-k", selection, test_file]
        result = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
        assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
        assert " passed" in result.stdout and " skipped" not in result.stdout, result.stdout[-2000:]


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_half_precision_checkpoint_computes_what_a_float32_load_of_it_does(checkpoint_factory, dtype, arch):
    """Weights widened exactly, the same kernels in the same order: identical logprobs, not close ones.
    qwen2 has q/k/v biases; the batch mixes prompt lengths, so steps mix prefill and decode. (Where
    bfloat16 takes vdpbf16ps, x is rounded to bfloat16 at each product: close, not identical.)"""
    path = checkpoint_factory(arch, dtype=dtype)
    half = LLM(str(path), dtype=dtype, show_progress=False)
    full = LLM(str(path), dtype="float32", show_progress=False)
    model = half.engine.model
    assert model.lm_head.layout is WeightLayout.PANELS and model.lm_head.weight.dtype == getattr(torch, dtype)
    assert half.kernels["weights"] == dtype and half.kernels["activations"] == "float32"
    assert half.engine.runner.kv_caches[0].dtype == torch.float32
    params = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True, logprobs=3)
    prompts = [[5, 6, 7, 8, 9], [3] * 21, [11, 12]]
    outs = [llm.generate(prompts, params, use_tqdm=False) for llm in (half, full)]
    if dtype == "bfloat16" and bf16_dot_build():
        for a, b in zip(*outs, strict=True):
            assert a.outputs[0].cumulative_logprob == pytest.approx(b.outputs[0].cumulative_logprob, abs=0.5)
        return
    for a, b in zip(*outs, strict=True):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert a.outputs[0].logprobs == b.outputs[0].logprobs


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_half_precision_kernel_path_agrees_with_torch_half_precision(checkpoint_factory, monkeypatch, dtype):
    """Against torch's own half-precision path (half-precision activations too): the same greedy
    tokens, and the log-softmax of the logits at every prompt position within 1e-2 in float16. In
    bfloat16 the torch path rounds every activation to 8 significant bits, which moves logprobs of
    magnitude ~12 by up to ~0.1 on this model; the kernel path computes the float32 result exactly
    (the test above), so the difference is the torch path's rounding."""
    path = checkpoint_factory("llama", dtype=dtype)
    prompts = [[5, 6, 7, 8, 9], [3] * 21]
    kernel = LLM(str(path), dtype=dtype, show_progress=False, max_logprobs=VOCAB)
    monkeypatch.setitem(native._state, "ok", False)
    plain = LLM(str(path), dtype=dtype, show_progress=False, max_logprobs=VOCAB)
    assert plain.kernels["activations"] == dtype
    for prompt in prompts:
        ids = torch.tensor(prompt)
        logits = [_prompt_logits(llm, ids) for llm in (kernel, plain)]
        torch.testing.assert_close(logits[0], logits[1], rtol=0, atol=TORCH_HALF_ERROR[dtype])
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    outs = [llm.generate(prompts, params, use_tqdm=False) for llm in (kernel, plain)]
    for a, b in zip(*outs, strict=True):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids


def _prompt_logits(llm: LLM, ids: torch.Tensor) -> torch.Tensor:  # [T - 1, V] log-softmax of the logits
    params = SamplingParams(max_tokens=1, prompt_logprobs=VOCAB)
    out = llm.generate([ids.tolist()], params, use_tqdm=False)[0]
    rows = [entry for entry in out.prompt_logprobs or [] if entry is not None]
    return torch.tensor([[row[token].logprob for token in range(VOCAB)] for row in rows])


def test_auto_dtype_is_the_checkpoints_own_where_the_kernels_stream_it(checkpoint_factory, monkeypatch):
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert resolve_dtype("auto", cpu, torch.bfloat16, fast_half_on_cpu=True) == torch.bfloat16
    assert resolve_dtype(None, cpu, torch.float16, fast_half_on_cpu=True) == torch.float16
    assert resolve_dtype("auto", cpu, torch.bfloat16, fast_half_on_cpu=False) == torch.float32
    assert resolve_dtype("auto", cpu, torch.float32, fast_half_on_cpu=True) == torch.float32
    assert resolve_dtype("auto", cuda, torch.float32) == torch.bfloat16
    assert resolve_dtype("auto", cuda, torch.float16) == torch.float16
    llm = LLM(str(checkpoint_factory("llama", dtype="bfloat16")), show_progress=False)
    assert llm.kernels["weights"] == "bfloat16" and llm.kernels["linear"].startswith("weft panels")
    monkeypatch.setitem(native._state, "ok", False)
    plain = LLM(str(checkpoint_factory("llama", dtype="bfloat16")), show_progress=False)
    assert plain.kernels == {
        "kernels": "torch",
        "weights": "float32",
        "activations": "float32",
        "linear": "torch x @ W",
    }


PEAK_SCRIPT = """
import sys
from pathlib import Path
import torch
import weft.native
from weft.model.loader import load_config, load_model

def kib(field):
    for line in open("/proc/self/status"):
        if line.startswith(field):
            return int(line.split()[1]) * 1024

assert weft.native.kernels_available()
path = Path(sys.argv[1])
config = load_config(path)
before = kib("VmRSS")
model = load_model(path, config, torch.bfloat16, torch.device("cpu"), 256, show_progress=False)
assert model.embed.from_panels and model.lm_head.weight.dtype == torch.bfloat16
print(before, kib("VmHWM"))
"""


def test_loading_a_bfloat16_checkpoint_peaks_near_its_size(tmp_path):
    """No float32 copy, no mapped file and no second embedding table beside the packed weights: the
    loading process's peak resident memory grows by at most 1.3x the checkpoint's size (a
    SmolLM2-135M shape, 270 MB; the table packed for the tied lm_head is 21% of it)."""
    if not Path("/proc/self/status").exists():
        pytest.skip("peak resident memory is read from /proc (Linux)")
    from checkpoints import build_checkpoint

    path = build_checkpoint(
        tmp_path,
        "llama",
        dtype="bfloat16",
        vocab_size=49152,
        hidden_size=576,
        intermediate_size=1536,
        num_hidden_layers=30,
        num_attention_heads=9,
        num_key_value_heads=3,
    )
    size = sum(f.stat().st_size for f in path.glob("*.safetensors"))
    result = subprocess.run([sys.executable, "-c", PEAK_SCRIPT, str(path)], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-3000:]
    before, peak = (int(v) for v in result.stdout.split())
    assert peak - before <= 1.3 * size, (
        f"loading {size / 1e6:.0f} MB peaked {(peak - before) / 1e6:.0f} MB higher"
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_long_prefill_multiplies_through_a_dense_copy_of_the_weights(dtype):
    """At DENSE_PANEL_ROWS rows and more a packed Linear uses the BLAS GEMM on W.T rebuilt from its
    panels (half precision widened exactly, an odd input width, a bias): the same as F.linear on
    the float32 widening of the weight, and close to the packed kernel itself (this build's)."""
    from weft.model.layers import DENSE_PANEL_ROWS, Linear, WeightLayout

    gen = torch.Generator().manual_seed(1)
    layer = Linear(577, 70, bias=True)
    layer.weight.data = torch.randn(70, 577, generator=gen).to(dtype)
    layer.bias.data = torch.randn(70, generator=gen)
    weight, bias = layer.weight.data.float().clone(), layer.bias.data.clone()
    layer.set_layout(WeightLayout.PANELS)
    x = torch.randn(DENSE_PANEL_ROWS, 577, generator=gen)
    out = layer(x)
    assert torch.equal(out, torch.nn.functional.linear(x, weight, bias))
    panels = torch.ops.weft.packed_linear(x, layer.weight, layer.bias, 70)
    torch.testing.assert_close(out, panels, rtol=1e-4, atol=1e-4)
