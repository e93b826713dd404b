"""The per-machine choice of the prefill GEMM (weft/model/prefill_gemm.py): the crossover rule, the
cache, the override, and a real measurement on packed weights."""

from __future__ import annotations

import os

import pytest
import torch

import weft.native as native
from weft import LLM, SamplingParams
from weft.config import NativeConfig
from weft.engine.engine import LLMEngine
from weft.model import prefill_gemm
from weft.model.layers import GENERATED_ROWS, Linear, StepRows, WeightLayout
from weft.model.prefill_gemm import (
    CANDIDATE_ROWS,
    NEVER,
    apply_dense_rows,
    choose_dense_rows,
    crossover,
    linear_shape,
    measure_paths,
)
from weft.params import OutputKind


@pytest.fixture(autouse=True)
def kernels():
    if not native.kernels_available():
        pytest.skip("weft's CPU kernels are off (WEFT_NATIVE=0) or could not be built here")


def packed(in_features: int, out_features: int, dtype: torch.dtype = torch.float32) -> Linear:
    """A Linear with random [out, in] weights (kept as `.original`) packed into panels."""
    lin = Linear(in_features, out_features)
    gen = torch.Generator().manual_seed(0)
    lin.weight.data = torch.randn(out_features, in_features, generator=gen).to(dtype)
    lin.original = lin.weight.data.float()
    lin.set_layout(WeightLayout.PANELS)
    return lin


def fake_measure(dense_faster_from: int, lucky: tuple[int, ...] = ()):
    """Times where the dense GEMM is faster from `dense_faster_from` rows, and at `lucky` (noise)."""

    def measure(linear: Linear, rows: int) -> tuple[float, float]:
        return (1.0, 0.5) if rows >= dense_faster_from or rows in lucky else (1.0, 2.0)

    return measure


def test_crossover_is_where_the_gemm_keeps_winning():
    lin = packed(64, 64)
    assert crossover(lin, fake_measure(1024)) == 1024
    assert crossover(lin, fake_measure(1024, lucky=(256,))) == 1024  # a win below a loss does not count
    assert crossover(lin, fake_measure(4096, lucky=(1024,))) == NEVER
    assert crossover(lin, fake_measure(512)) == 512
    assert crossover(lin, fake_measure(10**9)) == NEVER
    assert crossover(lin, lambda _lin, _rows: (1.0, 0.5)) == CANDIDATE_ROWS[0]


def test_thresholds_are_cached_per_shape_and_the_override_measures_nothing(tmp_path):
    linears = [packed(64, 96), packed(64, 96), packed(96, 64), packed(64, 96, torch.bfloat16)]
    shapes = [linear_shape(lin) for lin in linears]
    calls: list[tuple[int, int]] = []

    def measure(linear, rows):
        calls.append((linear.in_features, rows))
        return fake_measure(512)(linear, rows)

    chosen = choose_dense_rows(shapes, tmp_path, measure=measure)
    assert len(chosen) == 3 and set(chosen.values()) == {512}  # float32 and bfloat16 are two shapes
    assert len(calls) == 3 * len(CANDIDATE_ROWS)
    apply_dense_rows(linears, chosen)
    assert all(lin.dense_rows == 512 for lin in linears)
    calls.clear()
    assert set(choose_dense_rows(shapes[1:3], tmp_path, measure=measure).values()) == {512}
    assert calls == []  # from the cache file
    assert choose_dense_rows(shapes[:1], tmp_path, fixed=300, measure=measure) == {shapes[0]: 300}
    assert calls == []


def test_a_broken_cache_file_is_measured_again(tmp_path):
    (tmp_path / prefill_gemm.CACHE_FILE).write_text("{not json")
    shape = (64, 96, torch.float32)
    assert choose_dense_rows([shape], tmp_path, measure=fake_measure(2048)) == {shape: 2048}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_both_paths_measured_compute_the_same_product(dtype):
    lin = packed(200, 1100, dtype)  # more columns than one probe takes
    panel_s, dense_s = measure_paths(lin, 256)
    assert panel_s > 0 and dense_s > 0
    x = torch.randn(300, 200)
    expected = x @ lin.original.T
    torch.testing.assert_close(lin.panel_forward(x), expected, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(lin.dense_forward(x), expected, rtol=1e-4, atol=1e-4)


def test_a_model_load_measures_its_shapes_and_says_so(tiny_llama, monkeypatch):
    """A real load measures in a child process (which finds weft's kernels already built in the
    cache directory) and writes the cache; a fresh cache file, so that it measures."""
    monkeypatch.delenv("WEFT_DENSE_ROWS")
    cache_file = NativeConfig.from_env().cache_dir / f"dense-rows-test-{os.getpid()}.json"
    monkeypatch.setattr(prefill_gemm, "CACHE_FILE", cache_file.name)
    try:
        llm = LLM(str(tiny_llama), show_progress=False, device="cpu", dtype="float32")
        assert cache_file.is_file()
    finally:
        cache_file.unlink(missing_ok=True)
    model = llm.engine.model
    thresholds = set(model.dense_rows.values())
    assert thresholds <= {*CANDIDATE_ROWS, NEVER}
    assert model.lm_head.dense_rows == prefill_gemm.DENSE_PANEL_ROWS  # the lm_head keeps the default
    assert llm.kernels["prefill_gemm"].startswith("torch GEMM from ")


def test_generated_rows_take_the_panels_in_a_gemm_step():
    """A step whose prompt rows take the GEMM computes its generated rows through the panels, bit for
    bit what they give alone; the prompt rows are the GEMM's."""
    lin = packed(200, 300)
    lin.dense_rows = 8
    x = torch.randn(40, 200)
    generated = torch.tensor([0, 17, 39])
    out = lin(x, StepRows(37, generated))
    assert torch.equal(out[generated], lin.panel_forward(x[generated]))
    prompt = torch.ones(40, dtype=torch.bool)
    prompt[generated] = False
    assert torch.equal(out[prompt], lin.dense_forward(x)[prompt])
    assert torch.equal(lin(x, StepRows(7, generated)), lin.panel_forward(x))  # under the threshold
    assert torch.equal(lin(x, GENERATED_ROWS), lin.panel_forward(x))
    assert torch.equal(lin(x), lin.dense_forward(x))  # no step: every row counts, as in scoring
    sliced = StepRows(37, generated).slice(10, 30)
    assert sliced.num_prompt == 19 and sliced.generated is not None and sliced.generated.tolist() == [7]


def _decoding(engine: LLMEngine, other_at: int | None) -> list:
    """A greedy request with logprobs, and from step `other_at` on another with a long prompt."""
    params = SamplingParams(temperature=0, max_tokens=12, logprobs=3, output_kind=OutputKind.FINAL_ONLY)
    engine.add_request("a", "hello there", params)
    finished, step = [], 0
    while engine.has_unfinished_requests():
        if step == other_at:
            engine.add_request("b", "the quick brown fox " * 12, params)
        finished += engine.step()
        step += 1
    (a,) = [o for o in finished if o.request_id == "a"]
    return [(c.token_ids, c.logprobs, c.cumulative_logprob) for c in a.outputs]


def test_a_long_prompt_beside_a_decoding_request_changes_none_of_its_numbers(checkpoint_factory):
    """With thresholds low enough that the other request's prompt takes the GEMM, the decoding
    request's rows in that step still take the panels: its logprobs are bit for bit the same as
    alone (the step's own count of rows used to send them through the GEMM too). Sums over 256
    inputs and more, where the GEMM's rounding differs from the panels'."""
    checkpoint = checkpoint_factory("llama", hidden_size=256, intermediate_size=512)
    engine = LLM(str(checkpoint), show_progress=False, device="cpu", dtype="float32").engine
    body = [m for m in engine.model.modules() if isinstance(m, Linear) and m is not engine.model.lm_head]
    for lin in body:
        lin.dense_rows = 8
    alone = _decoding(engine, None)
    for other_at in (1, 3, 6):
        assert _decoding(engine, other_at) == alone, other_at
