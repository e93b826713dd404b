"""The Triton kernels around a decode step, against `TorchKernels`: logprobs (weft/cuda/logprobs.py:
the chosen token's logprob and rank and the top n by logprob then id, on logits that tie, hold NaN
or -inf, rows given their own normalizer, rows of one slice or several), greedy tokens (greedy.py)
and a replayed graph's inputs (graph_rows.py). On a CUDA GPU where there is one, else in Triton's
interpreter."""

from __future__ import annotations

import pytest
import torch

from weft.cuda.kernels import TRITON_KERNELS
from weft.cuda.logprobs import SLICE, row_logprobs
from weft.kernels import TorchKernels

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
REFERENCE = TorchKernels()


def same(x: torch.Tensor, ids: torch.Tensor, num_top: int, norm: torch.Tensor | None = None) -> None:
    expected = REFERENCE.row_logprobs(x, ids, num_top, norm)
    got = row_logprobs(x.to(DEVICE), ids.to(DEVICE), num_top, None if norm is None else norm.to(DEVICE))
    assert torch.equal(got[0].cpu(), expected[0]), (got[0], expected[0])
    assert torch.equal(got[2].cpu(), expected[2]), (got[2], expected[2])
    torch.testing.assert_close(got[1].cpu(), expected[1], rtol=1e-5, atol=1e-5, equal_nan=True)


@pytest.mark.parametrize("num_top", [0, 1, 5, 20])
def test_logprobs_of_rows_of_several_slices(num_top):
    gen = torch.Generator().manual_seed(num_top)
    x = torch.randn(3, 2 * SLICE + 808, generator=gen) * 3
    same(x, torch.tensor([5, 2 * SLICE + 807, SLICE]), num_top)


def test_ties_go_to_the_smaller_id():
    gen = torch.Generator().manual_seed(1)
    x = torch.round(torch.randn(2, SLICE + 904, generator=gen) * 2) / 2  # many equal logits
    same(x, torch.tensor([0, 17]), 7)


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # -inf - -inf, interpreted
def test_nan_and_minus_infinity():
    """-inf (masked tokens) ranks last, ties by id; a row holding a NaN is all NaN, its top the
    first ids; a row of -inf is NaN, as the CPU kernels make it."""
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(4, SLICE + 100, generator=gen)
    x[0, 100:] = float("-inf")
    x[1, 50] = float("nan")
    x[2] = float("-inf")
    same(x, torch.tensor([3, 4, 5, 6]), 5)


def test_a_given_normalizer_and_its_absence():
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(3, 5000, generator=gen)
    same(x, torch.tensor([1, 2, 3]), 4, torch.tensor([10.0, float("nan"), -2.0]))


def test_the_kernel_set_takes_them_for_float32_rows():
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(2, 300, generator=gen).to(DEVICE)
    ids = torch.tensor([1, 299], device=DEVICE)
    got = TRITON_KERNELS.row_logprobs(x, ids, 3)
    expected = REFERENCE.row_logprobs(x.cpu(), ids.cpu(), 3)
    assert torch.equal(got[0].cpu(), expected[0]) and torch.equal(got[2].cpu(), expected[2])
    torch.testing.assert_close(got[1].cpu(), expected[1], rtol=1e-5, atol=1e-5)


def test_greedy_tokens_are_the_first_largest_or_invalid():
    """One launch (weft/cuda/greedy.py) against `TorchKernels.greedy_tokens`: the first of equal
    maxima across the 4,096-logit iterations, -1 for a row holding a NaN or only -inf."""
    from weft.cuda.greedy import BLOCK, greedy_tokens

    gen = torch.Generator().manual_seed(5)
    x = torch.randn(5, 2 * BLOCK + 3, generator=gen)
    x[0, 7] = x[0, BLOCK + 9] = 50.0  # the same maximum in two iterations: the first wins
    x[1, 2 * BLOCK + 2] = 60.0  # in the last, partial iteration
    x[2, 11] = float("nan")
    x[3] = float("-inf")
    x[4, :100] = float("-inf")
    expected = REFERENCE.greedy_tokens(x, -1)
    assert expected.tolist()[:4] == [7, 2 * BLOCK + 2, -1, -1]
    assert torch.equal(greedy_tokens(x.to(DEVICE), -1).cpu(), expected)
    assert torch.equal(TRITON_KERNELS.greedy_tokens(x.to(DEVICE), -1).cpu(), expected)


FIELDS = ("ids", "positions", "slots", "table", "lengths")


@pytest.mark.parametrize(("num_rows", "size", "window"), [(3, 8, False), (8, 8, False), (2, 4, True)])
def test_decode_graph_rows_staged_in_one_launch(num_rows, size, window):
    """weft/cuda/graph_rows.py against `TorchKernels.stage_decode_rows`: the step's rows copied into
    the static buffers' first rows (a block table narrower than theirs), the rest padding rows on
    the scratch block, and no entry past either touched."""
    from weft.kernels import DecodeRows

    gen = torch.Generator().manual_seed(num_rows + size)

    def rows(count: int, width: int) -> DecodeRows:
        tensors = {name: torch.randint(0, 1000, (count,), generator=gen) for name in FIELDS}
        tensors["table"] = torch.randint(0, 1000, (count, width), generator=gen, dtype=torch.int32)
        tensors["lengths"] = tensors["lengths"].int()
        if window:  # the sliding-window pool's rows: slots and table only
            tensors["ids"] = tensors["positions"] = tensors["lengths"] = None
        return DecodeRows(**tensors)

    def on_device(r: DecodeRows) -> DecodeRows:
        return DecodeRows(*(None if (t := getattr(r, f)) is None else t.clone().to(DEVICE) for f in FIELDS))

    step, static = rows(num_rows, 5), rows(16, 12)
    expected, got = on_device(static), on_device(static)
    REFERENCE.stage_decode_rows(expected, on_device(step), size, 7, 16)
    TRITON_KERNELS.stage_decode_rows(got, on_device(step), size, 7, 16)
    for field in FIELDS:
        mine, theirs = getattr(got, field), getattr(expected, field)
        assert (mine is None) == (theirs is None)
        assert mine is None or torch.equal(mine.cpu(), theirs.cpu()), field
    assert (expected.slots[num_rows:size] == 7 * 16).all()
    assert torch.equal(expected.slots[size:].cpu(), static.slots[size:])
