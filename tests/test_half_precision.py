"""Half-precision weights on CPU: weft's panel kernel widens bfloat16 and float16 weights in
registers (float32 activations and accumulation), so a model loaded in half precision with float32
products computes exactly what a float32 load of the same checkpoint computes, at half the bytes
read per step; with bfloat16 products (`matmul_precision="bfloat16"`, the default where the CPU has
AVX512_BF16) it computes what a float32 load whose every matrix input is rounded to bfloat16 does.

Every ISA path of the kernels is tested on every machine: this machine's own build for real (its
bfloat16 products through vdpbf16ps, or through their emulation where the CPU lacks AVX512_BF16),
the other paths as separate builds, run in a child process where this CPU can run them and compiled
where it cannot (`test_other_builds_of_the_kernels_pass_the_same_tests`)."""

from __future__ import annotations

import os
import subprocess
import sys
import types
from pathlib import Path

import background
import pytest
import torch
from conftest import require_native_kernels
from other_builds import BUILDS, CHILD_BUILD, cache_dir, command, is_x86

import weft.native as native
from weft import LLM, SamplingParams
from weft.config import ConfigError, resolve_dtype
from weft.kernels import cpu_isa_path
from weft.model import glu
from weft.model.layers import Linear, RMSNorm, StepRows, WeightLayout
from weft.model.prefill_gemm import NEVER

HALF = [torch.bfloat16, torch.float16]
VOCAB = 384  # the tiny checkpoints' vocabulary
TORCH_HALF_ERROR = {"float16": 1e-2, "bfloat16": 1.5e-1}


@pytest.fixture(scope="module", autouse=True)
def kernels():
    require_native_kernels()


@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize("rows", [*range(1, 14), 16, 25, 40])
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("in_features", [45, 64])
def test_half_precision_panels_match_f_linear_in_float32(dtype, rows, bias, in_features):
    """Every tile height (1-12 rows, and runs of tiles), odd sizes (a last panel of 13 columns, an
    odd number of input features), against F.linear in float32 on the very same half-precision
    weights; bfloat16 panels also with bfloat16 products, against F.linear on x rounded to bfloat16
    as that path rounds it (vdpbf16ps, or its emulation on CPUs without it)."""
    gen = torch.Generator().manual_seed(rows)
    out_features = 77
    weight = torch.randn(out_features, in_features, generator=gen).to(dtype)
    b = torch.randn(out_features, generator=gen) if bias else None
    x = torch.randn(rows, in_features, generator=gen)
    panels = torch.ops.weft.pack_linear_weight(weight)
    rounded = dtype == torch.bfloat16 and in_features % 2  # bfloat16 panels hold rows in pairs
    assert panels.dtype == dtype and panels.shape == (3, in_features + rounded, 32)
    out = torch.ops.weft.packed_linear(x, panels, b, out_features)
    expected = torch.nn.functional.linear(x, weight.float(), b)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    if dtype == torch.bfloat16:
        out = torch.ops.weft.packed_linear(x, panels, b, out_features, True)
        expected = torch.nn.functional.linear(x.bfloat16().float(), weight.float(), b)
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


@pytest.mark.parametrize("rows", [*range(1, 14), 25, 40, 300])
@pytest.mark.parametrize(("intermediate", "in_features"), [(32, 45), (96, 64)])
def test_fused_mlp_computes_the_products_and_silu_mul_it_replaces(rows, intermediate, in_features):
    """packed_glu_pairs (an MLP's gate|up projection with bfloat16 products, silu(gate) * up rounded
    to the down projection's bfloat16 pairs as its tiles are stored) and packed_linear_pairs (the
    down projection from them) against the three steps they replace: bit for bit, every tile height
    and runs of tiles, odd input features, more rows than one block of x; and against the plain
    formula on inputs rounded to bfloat16."""
    gen = torch.Generator().manual_seed(rows)
    gate_up = (torch.randn(2 * intermediate, in_features, generator=gen) / 4).bfloat16()  # gate | up
    down = (torch.randn(40, intermediate, generator=gen) / 4).bfloat16()
    bias = torch.randn(40, generator=gen)
    x = torch.randn(rows, in_features, generator=gen) * 3
    gate_up_panels, down_panels = map(torch.ops.weft.pack_linear_weight, (gate_up, down))
    pairs = torch.ops.weft.packed_glu_pairs(x, gate_up_panels, intermediate)
    fused = torch.ops.weft.packed_linear_pairs(pairs, rows, down_panels, bias, 40)
    product = torch.ops.weft.packed_linear(x, gate_up_panels, None, 2 * intermediate, True)
    act = torch.ops.weft.silu_mul(product)
    apart = torch.ops.weft.packed_linear(act, down_panels, bias, 40, True)
    assert fused.shape == (rows, 40) and torch.equal(fused, apart)
    gate, up = torch.nn.functional.linear(x.bfloat16().float(), gate_up.float()).chunk(2, dim=1)
    formula = torch.nn.functional.silu(gate) * up  # [rows, I], rounded as the pairs are
    expected = torch.nn.functional.linear(formula.bfloat16().float(), down.float(), bias)
    torch.testing.assert_close(fused, expected, rtol=1e-2, atol=1e-2)


def test_fused_mlp_refuses_what_it_does_not_fuse():
    x = torch.randn(3, 8)
    pack = torch.ops.weft.pack_linear_weight
    with pytest.raises(RuntimeError, match="multiple of 32 MLP columns"):
        torch.ops.weft.packed_glu_pairs(x, pack(torch.randn(96, 8).bfloat16()), 48)
    with pytest.raises(RuntimeError, match="must be bfloat16"):
        torch.ops.weft.packed_glu_pairs(x, pack(torch.randn(64, 8).half()), 32)
    with pytest.raises(RuntimeError, match="out_features does not match"):
        torch.ops.weft.packed_glu_pairs(x, pack(torch.randn(64, 8).bfloat16()), 64)
    pairs = torch.ops.weft.packed_glu_pairs(x, pack(torch.randn(64, 8).bfloat16()), 32)
    with pytest.raises(RuntimeError, match="bfloat16 pairs of M rows"):
        torch.ops.weft.packed_linear_pairs(pairs, 20, pack(torch.randn(8, 32).bfloat16()), None, 8)  # 3 rows
    with pytest.raises(RuntimeError, match="input features"):
        torch.ops.weft.packed_linear_pairs(pairs, 3, pack(torch.randn(8, 64).bfloat16()), None, 8)


@pytest.mark.parametrize("rows", [*range(1, 14), 25, 300])
@pytest.mark.parametrize("in_features", [45, 64])
def test_norm_as_bfloat16_pairs_is_the_norm_then_its_rounding(rows, in_features):
    """add_rms_norm_pairs_ (the residual add and the norm, written as the bfloat16 pairs that the
    next products read) against add_rms_norm_ followed by the products that round their float32
    input: bit for bit, with and without the residual, into a q|k|v product and a fused MLP, every
    tile height, odd features; the residual stream updated alike."""
    gen = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, in_features, generator=gen) * 3
    delta = torch.randn(rows, in_features, generator=gen)
    weight = torch.rand(in_features, generator=gen) + 0.5
    qkv = torch.ops.weft.pack_linear_weight((torch.randn(40, in_features, generator=gen) / 4).bfloat16())
    gate_up = torch.ops.weft.pack_linear_weight((torch.randn(64, in_features, generator=gen) / 4).bfloat16())
    for residual in (delta, None):
        stream, expected_stream = x.clone(), x.clone()
        pairs = torch.ops.weft.add_rms_norm_pairs_(stream, residual, weight, 1e-5)
        if residual is None:
            normed = torch.ops.weft.rms_norm(expected_stream, weight, 1e-5)
        else:
            normed = torch.ops.weft.add_rms_norm_(expected_stream, residual, weight, 1e-5)
        assert torch.equal(stream, expected_stream)
        out = torch.ops.weft.packed_linear_pairs(pairs, rows, qkv, None, 40)
        assert torch.equal(out, torch.ops.weft.packed_linear(normed, qkv, None, 40, True))
        glu = torch.ops.weft.packed_glu_pairs_from_pairs(pairs, rows, gate_up, 32)
        assert torch.equal(glu, torch.ops.weft.packed_glu_pairs(normed, gate_up, 32))


def test_norm_as_bfloat16_pairs_refuses_bad_input():
    weight = torch.ones(8)
    with pytest.raises(RuntimeError, match="x must be a contiguous float32"):
        torch.ops.weft.add_rms_norm_pairs_(torch.randn(3, 8).bfloat16(), None, weight, 1e-5)
    with pytest.raises(RuntimeError, match="delta must be a contiguous float32 CPU tensor of x's shape"):
        torch.ops.weft.add_rms_norm_pairs_(torch.randn(3, 8), torch.randn(2, 8), weight, 1e-5)
    with pytest.raises(RuntimeError, match="weight must be float32"):
        torch.ops.weft.add_rms_norm_pairs_(torch.randn(3, 8), None, torch.ones(9), 1e-5)
    pairs = torch.ops.weft.add_rms_norm_pairs_(torch.randn(3, 8), None, weight, 1e-5)
    gate_up = torch.ops.weft.pack_linear_weight(torch.randn(64, 8).bfloat16())
    with pytest.raises(RuntimeError, match="bfloat16 pairs of M rows"):
        torch.ops.weft.packed_glu_pairs_from_pairs(pairs, 30, gate_up, 32)
    with pytest.raises(RuntimeError, match=r"got panels \[2, 8, 32\] for I = 64"):
        torch.ops.weft.packed_glu_pairs_from_pairs(pairs, 3, gate_up, 64)


def test_half_precision_kernel_rejects_half_precision_activations():
    panels = torch.ops.weft.pack_linear_weight(torch.randn(32, 8).bfloat16())
    with pytest.raises(RuntimeError, match="x must be a float32"):
        torch.ops.weft.packed_linear(torch.randn(2, 8).bfloat16(), panels, None, 32)
    with pytest.raises(RuntimeError, match="bias must be a contiguous float32"):
        torch.ops.weft.packed_linear(torch.randn(2, 8), panels, torch.randn(32).bfloat16(), 32)
    float16 = torch.ops.weft.pack_linear_weight(torch.randn(32, 8).half())
    with pytest.raises(RuntimeError, match="bf16_dot needs bfloat16 panels"):
        torch.ops.weft.packed_linear(torch.randn(2, 8), float16, None, 32, True)


@pytest.mark.slow
@pytest.mark.background
@pytest.mark.parametrize("path", list(BUILDS))
def test_other_builds_of_the_kernels_pass_the_same_tests(path):
    """Each ISA path this machine's own build does not take: built, and where this CPU can run it,
    this file's accuracy tests and the other kernels' tests run against it in child processes; where
    it cannot, compiled (tests/other_builds.py, started in the background at collection)."""
    if not is_x86():
        pytest.skip("these are x86 builds")
    if os.environ.get(CHILD_BUILD):
        pytest.skip("a child process testing another build builds no further ones")
    if BUILDS[path][2] == cpu_isa_path():
        pytest.skip(f"this machine's own build takes the {path} path: every test here runs against it")
    if not background.started(f"build-{path}"):  # a run that did not go through the collection hook
        background.start(f"build-{path}", command(path, cache_dir(path)))
    code, output = background.finish(f"build-{path}")
    assert code == 0, output[-6000:]


def bfloat16_rounded_reference(llm: LLM) -> LLM:
    """Make a float32 load compute what bfloat16 products compute, the plain way: every matrix input
    rounded to bfloat16, then float32 products (exact for bfloat16 values) on the float32 panels;
    layer by layer (no fused stack) and never through the dense GEMM."""
    model = llm.engine.model
    model.stack = None
    model.attention.bf16_dot = True  # prefill attention's products: the kernel's own rounding (test_native)

    def rounded_forward(self: Linear, x: torch.Tensor, rows: StepRows | None = None) -> torch.Tensor:
        return torch.ops.weft.packed_linear(x.bfloat16().float(), self.weight, self.bias, self.out_features)

    for module in model.modules():
        if isinstance(module, Linear):
            module.dense_rows = NEVER
            module.forward = types.MethodType(rounded_forward, module)  # type: ignore[method-assign]
    return llm


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_half_precision_checkpoint_computes_what_a_float32_load_of_it_does(checkpoint_factory, dtype, arch):
    """With float32 products (the default for float16, and for bfloat16 on CPUs without AVX512_BF16)
    the weights are widened exactly, the same kernels run in the same order: identical logprobs, not
    close ones, on every machine. qwen2 has q/k/v biases; the batch mixes prompt lengths, so steps
    mix prefill and decode."""
    path = checkpoint_factory(arch, dtype=dtype)
    half = LLM(str(path), dtype=dtype, show_progress=False, device="cpu", matmul_precision="float32")
    full = LLM(str(path), dtype="float32", show_progress=False, device="cpu")
    model = half.engine.model
    assert model.lm_head.layout is WeightLayout.PANELS and model.lm_head.weight.dtype == getattr(torch, dtype)
    assert half.kernels["weights"] == dtype and half.kernels["activations"] == "float32"
    assert half.kernels["matmul"].startswith("float32") and not model.bf16_dot
    assert half.engine.runner.kv_caches[0].dtype == torch.float32
    params = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True, logprobs=3)
    prompts = [[5, 6, 7, 8, 9], [3] * 21, [11, 12]]
    outs = [llm.generate(prompts, params, use_tqdm=False) for llm in (half, full)]
    for a, b in zip(*outs, strict=True):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert a.outputs[0].logprobs == b.outputs[0].logprobs


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_bfloat16_products_compute_what_rounded_inputs_do(checkpoint_factory, arch):
    """bfloat16 products (vdpbf16ps here, or emulated) against a float32 load whose every matrix input
    is rounded to bfloat16: the same greedy tokens, and the same logprobs up to float32 rounding
    (1e-5) at nearly every position; the two sum in different orders, so now and then an activation
    a float32 ulp from a bfloat16 rounding boundary rounds the other way, which moves later logprobs
    by up to ~5e-3 (measured). Prefill attention rounds its products' inputs too (q, k, the
    probabilities, v); the reference attends with the same kernel (tested against exact attention in
    test_native.py). Against the exact float32 products of the same weights, the logprobs of every
    prompt position move by at most 0.25 (0.117 and 0.105 measured, logprobs down to -14) and by 0.03
    on average (0.014)."""
    path = checkpoint_factory(arch, dtype="bfloat16")
    options = {"show_progress": False, "device": "cpu", "max_logprobs": VOCAB}
    dot = LLM(str(path), dtype="bfloat16", matmul_precision="bfloat16", **options)
    assert dot.engine.model.bf16_dot and dot.engine.model.stack is not None
    mlp = dot.engine.model.layers[0].mlp  # its gate|up, activation and down run fused (weft/model/glu.py)
    assert glu.fuses(mlp.gate_up, mlp.down)
    assert dot.kernels["matmul"].startswith("bfloat16 products") and dot.kernels["activations"] == "float32"
    rounded = bfloat16_rounded_reference(LLM(str(path), dtype="float32", **options))
    exact = LLM(str(path), dtype="bfloat16", matmul_precision="float32", **options)
    ids = torch.randint(3, VOCAB, (40,), generator=torch.Generator().manual_seed(0))
    logits = {
        name: _prompt_logits(llm, ids) for name, llm in (("dot", dot), ("rounded", rounded), ("exact", exact))
    }
    close = (logits["dot"] - logits["rounded"]).abs()
    assert close.max() <= 2e-2 and (close <= 1e-5).float().mean() >= 0.9, close.max()
    drift = (logits["dot"] - logits["exact"]).abs()
    assert drift.max() <= 0.25 and drift.mean() <= 0.03, (drift.max(), drift.mean())
    params = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True, logprobs=3)
    prompts = [[5, 6, 7, 8, 9], [3] * 21, [11, 12]]
    outs = [llm.generate(prompts, params, use_tqdm=False) for llm in (dot, rounded)]
    for a, b in zip(*outs, strict=True):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        for pa, pb in zip(a.outputs[0].logprobs or [], b.outputs[0].logprobs or [], strict=True):
            shared = pa.keys() & pb.keys()  # the chosen token, and the top-3 but for a near tie at its end
            assert len(shared) >= 2 and all(abs(pa[t].logprob - pb[t].logprob) <= 2e-2 for t in shared)


def test_matmul_precision_is_chosen_by_the_cpu_and_checked(checkpoint_factory, monkeypatch):
    """auto: bfloat16 products for bfloat16 weights where the CPU has AVX512_BF16, float32 elsewhere
    and for other weights; bfloat16 products of float16 weights, or a precision the plain torch
    kernels cannot give, are a ConfigError that says what to do."""
    path = checkpoint_factory("llama", dtype="bfloat16")
    auto = LLM(str(path), dtype="bfloat16", show_progress=False, device="cpu")
    native_bf16 = cpu_isa_path() == "avx512_bf16"
    assert auto.engine.model.bf16_dot is native_bf16 and auto.kernels["isa"] == cpu_isa_path()
    how = "(vdpbf16ps)" if native_bf16 else None
    assert auto.kernels["matmul"].endswith(how) if how else auto.kernels["matmul"].startswith("float32")
    forced = LLM(str(path), dtype="bfloat16", show_progress=False, device="cpu", matmul_precision="bfloat16")
    assert forced.engine.model.bf16_dot and ("emulated" in forced.kernels["matmul"]) is not native_bf16
    assert LLM(str(path), dtype="float32", show_progress=False, device="cpu").kernels["matmul"] == "float32"
    with pytest.raises(ConfigError, match="needs bfloat16 weights"):
        LLM(str(path), dtype="float16", show_progress=False, device="cpu", matmul_precision="bfloat16")
    with pytest.raises(ConfigError, match="is not supported"):
        LLM(str(path), dtype="bfloat16", show_progress=False, device="cpu", matmul_precision="fp8")
    monkeypatch.setitem(native._state, "ok", False)
    with pytest.raises(ConfigError, match="run in the weights' dtype"):
        LLM(str(path), dtype="bfloat16", show_progress=False, device="cpu", matmul_precision="float32")


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_half_precision_kernel_path_agrees_with_torch_half_precision(checkpoint_factory, monkeypatch, dtype):
    """Against torch's own half-precision path (half-precision activations too): the same greedy
    tokens, and the log-softmax of the logits at every prompt position within 1e-2 in float16. In
    bfloat16 the torch path rounds every activation to 8 significant bits, which moves logprobs of
    magnitude ~12 by up to ~0.1 on this model; the kernel path computes the float32 result exactly
    (the test above), so the difference is the torch path's rounding."""
    path = checkpoint_factory("llama", dtype=dtype)
    prompts = [[5, 6, 7, 8, 9], [3] * 21]
    kernel = LLM(str(path), dtype=dtype, show_progress=False, device="cpu", max_logprobs=VOCAB)
    monkeypatch.setitem(native._state, "ok", False)
    plain = LLM(str(path), dtype=dtype, show_progress=False, device="cpu", max_logprobs=VOCAB)
    assert plain.kernels["activations"] == dtype
    for prompt in prompts:
        ids = torch.tensor(prompt)
        logits = [_prompt_logits(llm, ids) for llm in (kernel, plain)]
        torch.testing.assert_close(logits[0], logits[1], rtol=0, atol=TORCH_HALF_ERROR[dtype])
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    outs = [llm.generate(prompts, params, use_tqdm=False) for llm in (kernel, plain)]
    for a, b in zip(*outs, strict=True):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_norms_that_write_bfloat16_pairs_change_no_logprob(checkpoint_factory, arch, monkeypatch):
    """With bfloat16 products, a prompt's norms write the bfloat16 pairs that q|k|v and the fused MLP
    read (`RMSNorm.pairs_`, two per layer and one for the first): prompt logprobs bit for bit those
    of the norms' float32 output rounded by each product; qwen2 has q/k/v biases."""
    path = checkpoint_factory(arch, dtype="bfloat16")
    options = {"show_progress": False, "device": "cpu", "max_logprobs": VOCAB}
    llm = LLM(str(path), dtype="bfloat16", matmul_precision="bfloat16", **options)
    model = llm.engine.model
    assert model.norm_pairs
    calls = []
    pairs_ = RMSNorm.pairs_
    monkeypatch.setattr(RMSNorm, "pairs_", lambda self, *args: calls.append(1) or pairs_(self, *args))
    ids = torch.randint(3, VOCAB, (40,), generator=torch.Generator().manual_seed(1))
    with_pairs = _prompt_logits(llm, ids)
    assert len(calls) == 2 * len(model.layers)
    model.norm_pairs = False
    assert torch.equal(with_pairs, _prompt_logits(llm, ids)) and len(calls) == 2 * len(model.layers)


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
    llm = LLM(str(checkpoint_factory("llama", dtype="bfloat16")), show_progress=False, device="cpu")
    assert llm.kernels["weights"] == "bfloat16" and llm.kernels["linear"].startswith("weft panels")
    monkeypatch.setitem(native._state, "ok", False)
    plain = LLM(str(checkpoint_factory("llama", dtype="bfloat16")), show_progress=False, device="cpu")
    assert plain.kernels == {
        "kernels": "torch",
        "weights": "float32",
        "activations": "float32",
        "matmul": "float32",
        "linear": "torch x @ W",
        "kv_cache": f"float32 ({plain.stats()['kv_bytes_per_token']:,} bytes a token)",
    }


PEAK_SCRIPT = """
import sys
from pathlib import Path
import torch
import weft.native
from weft.kernels import NATIVE_CPU_KERNELS
from weft.model.loader import load_config, load_model

def kib(field):
    for line in open("/proc/self/status"):
        if line.startswith(field):
            return int(line.split()[1]) * 1024

assert weft.native.kernels_available()
path = Path(sys.argv[1])
config = load_config(path)
before = kib("VmRSS")
model = load_model(
    path, config, torch.bfloat16, torch.device("cpu"), 256, show_progress=False, kernels=NATIVE_CPU_KERNELS
)
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
