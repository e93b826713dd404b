"""Matrices multiplied in the GGUF file's own blocks (weft/native/file_dot.cpp: `file_linear`,
`file_linear_rows`): the dot panels' numbers bit for bit (qdot.cpp, itself held to llama.cpp's
arithmetic by test_qdot.py) for Q4_K and Q6_K, at every count of rows a step gives them, in parts of
either kind, with lane groups cut short; and a mixture of experts whose experts stay in the file
(`expert_weights="file"`) computing the same tokens and logprobs as from panels, its experts views
of the file's mapping. Run on every ISA build (tests/other_builds.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import require_native_kernels
from test_quant import random_q4_k, random_q6_k

from weft.config import ConfigError
from weft.model.layers import WeightLayout
from weft.model.quantized import QuantizedRows, cat_rows

KINDS = {"q4_k": (random_q4_k, 0), "q6_k": (random_q6_k, 1)}


@pytest.fixture(scope="module", autouse=True)
def kernels():
    require_native_kernels()


def blocks(kind: str, rows: int, k: int, seed: int) -> torch.Tensor:
    make, _ = KINDS[kind]
    return make(rows, k, seed=seed)


def panels_product(x: torch.Tensor, parts: list[tuple[str, torch.Tensor]]) -> torch.Tensor:
    """x times the parts stacked by rows, through the dot panels of the fused matrix."""
    fused = cat_rows([QuantizedRows(kind, rows) for kind, rows in parts])
    if isinstance(fused, QuantizedRows):
        packed, n = fused.pack(dot=True), fused.shape[0]
        return torch.ops.weft.packed_linear(x, packed, None, n, False)
    out = [
        torch.ops.weft.packed_linear(x, QuantizedRows(k, r).pack(dot=True), None, r.shape[0], False)
        for k, r in parts
    ]
    return torch.cat(out, dim=1)


@pytest.mark.parametrize("kind", ["q4_k", "q6_k"])
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 9])
@pytest.mark.parametrize("k", [256, 768, 2048])
def test_file_linear_equals_the_dot_panels(kind, rows, k):
    """70 output rows (four lane groups and a short one), every count of x rows a tile takes and more."""
    w = blocks(kind, 70, k, seed=rows + k)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows))
    got = torch.ops.weft.file_linear(x, [w], [KINDS[kind][1]])
    assert torch.equal(got, panels_product(x, [(kind, w)]))


def test_extreme_blocks_and_activations():
    """Q4_K blocks at the extremes of their scales and an activation row with a huge value: the
    integer sums are exact, so the panels' numbers still."""
    w = random_q4_k(48, 512, seed=3, extreme=True)
    x = torch.randn(3, 512)
    x[1, 7] = 3e4
    x[2] = 0.0
    assert torch.equal(torch.ops.weft.file_linear(x, [w], [0]), panels_product(x, [("q4_k", w)]))


def test_parts_of_two_kinds_stack_by_rows():
    """A gate|up of a Q4_K gate and a Q6_K up (and a part ending mid-group): each part's rows into
    its columns, as the fused matrix's panels give them."""
    gate, up = random_q4_k(40, 512, seed=1), random_q6_k(24, 512, seed=2)
    x = torch.randn(5, 512)
    got = torch.ops.weft.file_linear(x, [gate, up], [0, 1])
    want = torch.cat([panels_product(x, [("q4_k", gate)]), panels_product(x, [("q6_k", up)])], dim=1)
    assert torch.equal(got, want)


def test_rows_each_times_their_own_matrix():
    """`file_linear_rows`: row e of x times matrix e (a row's routed experts), each in two parts."""
    experts = [(random_q4_k(32, 512, seed=e), random_q4_k(32, 512, seed=e + 10)) for e in range(3)]
    x = torch.randn(3, 512)
    got = torch.ops.weft.file_linear_rows(x, [p for pair in experts for p in pair], [0] * 6, 2)
    for e, (gate, up) in enumerate(experts):
        assert torch.equal(got[e : e + 1], panels_product(x[e : e + 1], [("q4_k", gate), ("q4_k", up)]))


def test_bad_parts_are_refused_with_what_is_wrong():
    w = random_q4_k(16, 512, seed=0)
    x = torch.randn(1, 512)
    with pytest.raises(RuntimeError, match="kind must be 0 \\(Q4_K\\) or 1 \\(Q6_K\\)"):
        torch.ops.weft.file_linear(x, [w], [2])
    with pytest.raises(RuntimeError, match="rows of whole blocks"):
        torch.ops.weft.file_linear(x, [w], [1])  # Q4_K bytes read as Q6_K's
    with pytest.raises(RuntimeError, match="K a multiple of 256"):
        torch.ops.weft.file_linear(torch.randn(1, 500), [w], [0])
    with pytest.raises(RuntimeError, match="parts_per_matrix parts"):
        torch.ops.weft.file_linear_rows(torch.randn(2, 512), [w, w, w], [0, 0, 0], 2)


def mapped_from(address: int) -> str | None:
    """The file whose mapping holds `address` in this process (/proc/self/maps), or None."""
    for line in Path("/proc/self/maps").read_text().splitlines():
        span, *rest = line.split(maxsplit=5)
        start, end = (int(a, 16) for a in span.split("-"))
        if start <= address < end:
            return rest[4] if len(rest) == 5 else None
    return None


@pytest.fixture(scope="module")
def moe_file(checkpoint_factory, tmp_path_factory):
    """A Qwen3-MoE shape whose experts are Q4_K and Q6_K blocks (rows of 256 features), in llama.cpp's
    Q4_K_M mix, and a tokenizer for it."""
    from weft.bench.random_gguf import word_level_tokenizer, write_random_gguf

    source = checkpoint_factory("qwen3moe") / "config.json"
    config = json.loads(source.read_text())
    config.update(hidden_size=256, intermediate_size=256, moe_intermediate_size=256, mlp_only_layers=[])
    tmp = tmp_path_factory.mktemp("moe-file")
    (tmp / "config.json").write_text(json.dumps(config))
    path = write_random_gguf(tmp / "config.json", "q4_k_m", tmp / "moe.gguf", num_layers=2)
    return path, word_level_tokenizer(384, tmp / "tokenizer")


def test_experts_from_the_file_compute_what_panels_compute(moe_file):
    from weft import LLM, SamplingParams

    path, tokenizer = moe_file
    llms = {
        mode: LLM(str(path), tokenizer=str(tokenizer), show_progress=False, expert_weights=mode)
        for mode in ("file", "panels")
    }
    model = llms["file"].engine.model
    experts = [m for name, m in model.named_modules() if ".experts." in name and hasattr(m, "layout")]
    assert experts and all(m.layout is WeightLayout.FILE for m in experts)
    kinds = model.quantized_matrices()
    assert kinds.get("q4_k (file)", 0) > 0 and kinds.get("q6_k (file)", 0) > 0, kinds  # Q4_K_M's down in Q6_K
    assert not any("(file)" in kind for kind in llms["panels"].engine.model.quantized_matrices())
    assert all(mapped_from(m.file.parts[0].data_ptr()) == str(path) for m in experts)  # no copies
    params = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True, logprobs=3)
    for prompts in (
        [[5, 6, 7]],
        [[5, 6, 7, 8, 9, 10], [11, 12], [3] * 30],
    ):  # a row alone; a batch, a prefill
        outs = [llm.generate(prompts, params, use_tqdm=False) for llm in llms.values()]
        for a, b in zip(*outs, strict=True):
            assert a.outputs[0].token_ids == b.outputs[0].token_ids
            assert a.outputs[0].logprobs == b.outputs[0].logprobs


def test_the_fused_stack_runs_experts_from_the_file_with_the_layer_paths_numbers(moe_file):
    """Decode steps take every layer in `decoder_stack_`, the experts' products over the file's
    blocks (weft/native/experts.cpp): a row alone, a batch grouped by expert."""
    from weft import LLM, SamplingParams

    path, tokenizer = moe_file
    fused, layered = (
        LLM(str(path), tokenizer=str(tokenizer), show_progress=False, expert_weights="file", block_size=4)
        for _ in "ab"
    )
    assert fused.engine.model.stack is not None
    layered.engine.model.stack = None
    params = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True, logprobs=3)
    for prompts in ([[5, 6, 7]], [[5, 6, 7, 8, 9, 10], [11, 12], [3] * 30]):
        outs = [llm.generate(prompts, params, use_tqdm=False) for llm in (fused, layered)]
        for a, b in zip(*outs, strict=True):
            assert a.outputs[0].token_ids == b.outputs[0].token_ids
            assert a.outputs[0].logprobs == b.outputs[0].logprobs


def test_expert_weights_file_where_it_does_not_run_says_where_it_does(moe_file):
    from weft import LLM

    path, tokenizer = moe_file
    with pytest.raises(ConfigError, match="on CPU with int8 products"):
        LLM(
            str(path),
            tokenizer=str(tokenizer),
            show_progress=False,
            expert_weights="file",
            matmul_precision="float32",
        )
    with pytest.raises((ConfigError, ValueError), match="expert_weights"):
        LLM(str(path), tokenizer=str(tokenizer), show_progress=False, expert_weights="disk")
