"""The sampler against exact probabilities, with random logits and no model."""

from __future__ import annotations

import math
from dataclasses import dataclass

import pytest
import torch

from weft import ops
from weft.engine.loading import kernels_for
from weft.kernels import TORCH_KERNELS, TorchKernels
from weft.params import SamplingParams
from weft.sample.sampler import Sampler, SamplingBatch, SamplingColumns

VOCAB = 12
NUM_DRAWS = 20000


@dataclass
class Row:
    """The fields of a sequence that the sampler reads (`SamplingRow`)."""

    params: SamplingParams
    seed: int
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    eos_token_ids: frozenset[int] = frozenset({0})

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)


def make_requests(params: SamplingParams, count: int, prompt=(1, 2, 3), output=()) -> list[Row]:
    return [Row(params, i, list(prompt), list(output)) for i in range(count)]


# The tensor version of every step, and this CPU's kernel set (native sampling and top-p passes).
KERNEL_SETS = pytest.mark.parametrize(
    "kernels", [TORCH_KERNELS, kernels_for(torch.device("cpu"))], ids=lambda k: k.name
)


def sample_counts(
    logits_row: torch.Tensor, params: SamplingParams, kernels: TorchKernels = TORCH_KERNELS
) -> torch.Tensor:
    """Sample NUM_DRAWS times from one row (each draw a different seed); counts per token [V]."""
    requests = make_requests(params, NUM_DRAWS)
    batch = SamplingBatch.build(requests, VOCAB, torch.device("cpu"))
    out = Sampler(kernels=kernels)(logits_row.expand(NUM_DRAWS, -1).clone(), batch)
    return torch.bincount(out.token_ids, minlength=VOCAB).double()


def assert_matches(counts: torch.Tensor, expected_probs: torch.Tensor) -> None:
    """Pearson chi-square goodness of fit. The bound df + 6 * sqrt(2 df) is about 6 standard
    deviations above the statistic's mean: a correct sampler fails it with probability < 1e-6,
    while a wrong distribution at 20k draws exceeds it by orders of magnitude."""
    expected = expected_probs.double() * counts.sum()
    impossible = expected == 0
    assert counts[impossible].sum() == 0, f"sampled tokens with probability 0: {counts[impossible]}"
    support = ~impossible
    chi2 = (((counts - expected) ** 2)[support] / expected[support]).sum().item()
    df = int(support.sum()) - 1
    assert chi2 < df + 6 * math.sqrt(2 * max(df, 1)), f"chi2 {chi2:.1f} with {df} degrees of freedom"


@pytest.fixture
def logits() -> torch.Tensor:
    return torch.tensor([2.0, 1.5, 1.0, 0.5, 0.0, -0.5, -1.0, 3.0, 0.2, 0.1, -2.0, 1.2])


@KERNEL_SETS
def test_plain_sampling_matches_softmax(logits, kernels):
    assert_matches(sample_counts(logits, SamplingParams(temperature=1.0), kernels), logits.softmax(-1))


@KERNEL_SETS
def test_temperature(logits, kernels):
    expected = (logits / 0.5).softmax(-1)
    assert_matches(sample_counts(logits, SamplingParams(temperature=0.5), kernels), expected)


def test_top_k(logits):
    probs = logits.softmax(-1)
    keep = torch.zeros(VOCAB, dtype=torch.bool)
    keep[logits.argsort(descending=True)[:3]] = True
    expected = torch.where(keep, probs, 0.0)
    assert_matches(sample_counts(logits, SamplingParams(top_k=3)), expected / expected.sum())


@KERNEL_SETS
@pytest.mark.parametrize("top_p", [0.7, 0.95])
def test_top_p(logits, kernels, top_p):
    probs = logits.softmax(-1)
    order = probs.argsort(descending=True)
    keep = torch.zeros(VOCAB, dtype=torch.bool)
    mass = 0.0
    for idx in order.tolist():  # smallest set of most likely tokens reaching 0.7
        keep[idx] = True
        mass += probs[idx].item()
        if mass >= top_p:
            break
    expected = torch.where(keep, probs, 0.0)
    counts = sample_counts(logits, SamplingParams(top_p=top_p), kernels)
    assert_matches(counts, expected / expected.sum())


def test_min_p(logits):
    probs = logits.softmax(-1)
    expected = torch.where(probs >= 0.2 * probs.max(), probs, 0.0)
    assert_matches(sample_counts(logits, SamplingParams(min_p=0.2)), expected / expected.sum())


@KERNEL_SETS
def test_combined_filters_in_order(logits, kernels):
    scaled = (logits / 0.8).softmax(-1)
    keep = torch.zeros(VOCAB, dtype=torch.bool)
    keep[logits.argsort(descending=True)[:5]] = True  # top-k 5 first, then min-p within them
    within = torch.where(keep, scaled, 0.0)
    within = within / within.sum()
    expected = torch.where(within >= 0.3 * within.max(), within, 0.0)
    counts = sample_counts(logits, SamplingParams(temperature=0.8, top_k=5, min_p=0.3), kernels)
    assert_matches(counts, expected / expected.sum())


def test_statistical_test_can_fail(logits):
    counts = sample_counts(logits, SamplingParams(temperature=1.0))
    with pytest.raises(AssertionError):
        assert_matches(counts, (logits / 0.9).softmax(-1))


def test_greedy_takes_argmax(logits):
    requests = make_requests(SamplingParams(temperature=0), 3)
    out = Sampler()(logits.expand(3, -1).clone(), SamplingBatch.build(requests, VOCAB, torch.device("cpu")))
    assert out.token_ids.tolist() == [7, 7, 7]


def test_top_k_keeps_whole_tie_at_cutoff():
    row = torch.tensor([[3.0, 1.0, 2.0, 2.0, 0.0]])
    filtered = ops.apply_top_k(row, torch.tensor([2]), 2)
    assert torch.isfinite(filtered).tolist() == [[True, False, True, True, False]]


def test_seeded_rows_do_not_depend_on_batch_composition():
    torch.manual_seed(0)
    logits = torch.randn(6, 50)
    params = [
        SamplingParams(temperature=t, top_p=p)
        for t, p in [(1.0, 1.0), (0.7, 0.9), (0.0, 1.0), (1.3, 1.0), (1.0, 0.5), (0.9, 1.0)]
    ]
    requests = [Row(p, 100 + i, [1, 2], [], frozenset()) for i, p in enumerate(params)]
    full = Sampler()(logits.clone(), SamplingBatch.build(requests, 50, torch.device("cpu"))).token_ids
    for subset in ([0], [4, 1], [5, 3, 0], [1, 2, 3, 4]):
        sub_requests = [requests[i] for i in subset]
        out = Sampler()(logits[subset].clone(), SamplingBatch.build(sub_requests, 50, torch.device("cpu")))
        assert out.token_ids.tolist() == full[subset].tolist()


def test_keyed_noise_is_uniform_and_distinct():
    u = ops.keyed_uniform(torch.tensor([1, 2]), torch.tensor([5, 5]), 100000)
    assert u.min() > 0.0 and u.max() < 1.0
    assert abs(u.mean().item() - 0.5) < 0.005
    assert not torch.equal(u[0], u[1])
    again = ops.keyed_uniform(torch.tensor([2]), torch.tensor([5]), 100000)
    assert torch.equal(again[0], u[1])


def test_penalties_exact_values():
    logits = torch.tensor([[2.0, -1.0, 0.5, 1.0, 3.0]])
    prompt_ids = torch.tensor([[0, 5]])  # token 0 in the prompt (5 = padding)
    output_ids = torch.tensor([[1, 3, 3]])  # token 1 once, token 3 twice
    ops.apply_penalties(
        logits, prompt_ids, output_ids, torch.tensor([2.0]), torch.tensor([0.5]), torch.tensor([0.25])
    )
    expected = [2.0 / 2, -1.0 * 2 - 0.25 - 0.5, 0.5, 1.0 / 2 - 0.5 - 0.5, 3.0]
    torch.testing.assert_close(logits, torch.tensor([expected]))


def test_penalties_applied_per_row_through_sampler():
    logits = torch.zeros(2, VOCAB)
    logits[:, 5] = 1.0
    logits[:, 6] = 0.9
    penalized = SamplingParams(temperature=0, presence_penalty=1.0)
    plain = SamplingParams(temperature=0)
    requests = make_requests(penalized, 1, output=(5,)) + make_requests(plain, 1, output=(5,))
    out = Sampler()(logits, SamplingBatch.build(requests, VOCAB, torch.device("cpu")))
    assert out.token_ids.tolist() == [6, 5]


def test_min_tokens_bans_eos_and_stop_tokens():
    logits = torch.zeros(2, VOCAB)
    logits[:, 0] = 5.0  # EOS is by far the most likely
    logits[:, 4] = 4.0
    early = make_requests(SamplingParams(temperature=0, min_tokens=2, stop_token_ids=[4]), 1)
    late = make_requests(SamplingParams(temperature=0, min_tokens=2), 1, output=(9, 9))
    out = Sampler()(logits, SamplingBatch.build(early + late, VOCAB, torch.device("cpu")))
    assert out.token_ids.tolist()[1] == 0
    assert out.token_ids.tolist()[0] not in (0, 4)


def test_logprobs_rank_and_top_n(logits):
    requests = make_requests(SamplingParams(temperature=0, logprobs=3), 1)
    out = Sampler()(logits[None].clone(), SamplingBatch.build(requests, VOCAB, torch.device("cpu")))
    expected = torch.log_softmax(logits, -1)
    assert out.top_logprobs is not None
    assert out.top_logprobs.token_ids[0].tolist() == [7, 7, 0, 1]
    torch.testing.assert_close(out.top_logprobs.logprobs[0], expected[[7, 7, 0, 1]])
    assert out.top_logprobs.ranks.tolist() == [1]


def test_processed_logprobs_follow_temperature(logits):
    params = SamplingParams(temperature=0.5, logprobs=0, logprobs_mode="processed", seed=3)
    requests = make_requests(params, 1)
    out = Sampler()(logits[None].clone(), SamplingBatch.build(requests, VOCAB, torch.device("cpu")))
    token = out.token_ids[0]
    assert out.logprobs is not None
    torch.testing.assert_close(out.logprobs[0], torch.log_softmax(logits / 0.5, -1)[token])


def test_logits_processor_sees_output_tokens(logits):
    seen: list[list[int]] = []

    def force_token_2(token_ids: list[int], row: torch.Tensor) -> torch.Tensor:
        seen.append(token_ids)
        row = torch.full_like(row, float("-inf"))
        row[2] = 0.0
        return row

    requests = make_requests(SamplingParams(logits_processors=[force_token_2]), 1, output=(8, 9))
    requests += make_requests(SamplingParams(temperature=0), 1)
    out = Sampler()(logits.expand(2, -1).clone(), SamplingBatch.build(requests, VOCAB, torch.device("cpu")))
    assert out.token_ids.tolist() == [2, 7]
    assert seen == [[8, 9]]


def test_row_argmax_takes_the_first_of_tied_maxima():
    logits = torch.tensor([[0.0, 3.0, 1.0, 3.0], [5.0, 5.0, 5.0, 5.0], [-1.0, -2.0, -1.0, -3.0]])
    assert ops.row_argmax(logits).tolist() == [1, 0, 0]
    wide = torch.zeros(3, 49152)
    wide[:, [17, 40000]] = 2.0  # ties far apart in a real-size vocabulary
    assert ops.row_argmax(wide).tolist() == [17, 17, 17]


def test_only_the_rows_that_ask_get_logprobs():
    """Rows without logprobs pay nothing: the logprobs cover the asking rows only, with the same
    values as when every row asks."""
    gen = torch.Generator().manual_seed(5)
    logits = torch.randn(4, VOCAB, generator=gen)
    asking = SamplingParams(temperature=0, logprobs=2)
    plain = SamplingParams(temperature=0)
    mixed = [Row(p, i, [1, 2], []) for i, p in enumerate([plain, asking, plain, asking])]
    out = Sampler()(logits.clone(), SamplingBatch.build(mixed, VOCAB, torch.device("cpu")))
    everyone = [Row(asking, i, [1, 2], []) for i in range(4)]
    full = Sampler()(logits.clone(), SamplingBatch.build(everyone, VOCAB, torch.device("cpu")))
    assert out.top_logprobs is not None and full.top_logprobs is not None
    assert out.top_logprobs.rows == (1, 3) and full.top_logprobs.rows == (0, 1, 2, 3)
    assert out.top_logprobs.token_ids.shape == (2, 3)
    torch.testing.assert_close(out.top_logprobs.logprobs, full.top_logprobs.logprobs[[1, 3]])
    assert torch.equal(out.top_logprobs.token_ids, full.top_logprobs.token_ids[[1, 3]])
    assert torch.equal(out.token_ids, full.token_ids)


def _assert_same_batch(a: SamplingBatch, b: SamplingBatch) -> None:
    for name in SamplingColumns.__dataclass_fields__:
        x, y = getattr(a.columns, name), getattr(b.columns, name)
        assert torch.equal(x, y) if isinstance(x, torch.Tensor) else x == y, name
    for name in SamplingBatch.__dataclass_fields__:
        x, y = getattr(a, name), getattr(b, name)
        if name == "columns":
            continue
        if isinstance(x, torch.Tensor):
            assert torch.equal(x, y), name
        elif name == "penalties" and x is not None:
            for field in ("prompt_ids", "output_ids", "repetition", "presence", "frequency"):
                assert torch.equal(getattr(x, field), getattr(y, field)), field
        elif name == "banned" and x is not None:
            assert all(torch.equal(u, v) for u, v in zip(x, y, strict=True))
        else:
            assert x == y, name


def test_batch_builder_matches_a_fresh_build_as_rows_join_leave_and_grow():
    """The builder keeps the static columns while the rows are the same, and its batches always
    equal one built from scratch (randomized joins, leaves, reorders and growing outputs)."""
    import random

    from weft.sample.sampler import SamplingBatchBuilder

    rng = random.Random(0)
    choices = [
        SamplingParams(temperature=0),
        SamplingParams(temperature=0.7, top_k=3, seed=1),
        SamplingParams(top_p=0.8, min_p=0.1, logprobs=2),
        SamplingParams(repetition_penalty=1.3, presence_penalty=0.5, min_tokens=2),
        SamplingParams(temperature=1.2, logprobs=1, logprobs_mode="processed"),
    ]
    pool = [Row(rng.choice(choices), i, [1 + i % 5, 2], []) for i in range(12)]
    rows = pool[:4]
    builder, reused = SamplingBatchBuilder(), 0
    for _ in range(60):
        action = rng.random()
        if action < 0.15:
            rows = [*rows, rng.choice([r for r in pool if all(r is not x for x in rows)] or pool)]
        elif action < 0.3 and len(rows) > 1:
            victim = rng.choice(rows)
            rows = [r for r in rows if r is not victim]
        elif action < 0.35:
            rows = rng.sample(rows, len(rows))
        for row in rows:
            row.output_token_ids.append(rng.randrange(VOCAB))
        before = builder._static
        batch = builder.build(rows, VOCAB, torch.device("cpu"))
        reused += builder._static is before
        _assert_same_batch(batch, SamplingBatch.build(rows, VOCAB, torch.device("cpu")))
    assert reused > 20  # the steady state really reuses


def test_top_alternatives_break_ties_by_token_id():
    """One documented rule: the top-n are ordered by logprob, then by token id, including which of
    several tied tokens make the cut; the rank counts strictly better tokens."""
    logits = torch.tensor(
        [
            [0.0, 2.0, 1.0, 2.0, 1.0, 1.0, -1.0, 2.0, 1.0, 0.0, 0.0, 1.0],
            [float("-inf")] * 4 + [0.5] * 3 + [float("-inf")] * 5,
        ]
    )
    logprobs = torch.log_softmax(logits, dim=-1)
    ids, values = TORCH_KERNELS.top_by_value_then_index(logprobs, 5)
    assert ids.tolist() == [[1, 3, 7, 2, 4], [4, 5, 6, 0, 1]]
    torch.testing.assert_close(values, logprobs.gather(1, ids))
    full_ids, _, ranks = TORCH_KERNELS.row_logprobs(logits, torch.tensor([8, 6]), 5)
    assert full_ids[:, 0].tolist() == [8, 6] and ranks.tolist() == [4, 1]
    assert TORCH_KERNELS.top_by_value_then_index(logprobs, 0)[0].shape == (2, 0)


def test_top_alternatives_match_a_full_stable_sort():
    gen = torch.Generator().manual_seed(11)
    logits = torch.randint(-3, 3, (6, 40), generator=gen).float()  # many ties
    logprobs = torch.log_softmax(logits, dim=-1)
    for n in (1, 4, 17, 40):
        ids, _ = TORCH_KERNELS.top_by_value_then_index(logprobs, n)
        expected = torch.sort(logprobs, dim=-1, descending=True, stable=True).indices[:, :n]
        assert torch.equal(ids, expected), n


def test_uniform_noise_never_reaches_one_so_masked_tokens_stay_unsampled():
    # The largest draw must stay below 1: Gumbel noise of u = 1.0 is +inf, and +inf on a masked
    # (-inf) logit is NaN, which the argmax picks (a forbidden token, once in ~16M draws).
    extremes = ops.bits_to_uniform(torch.tensor([0, (1 << ops.UNIFORM_BITS) - 1]))
    assert extremes[0].item() > 0.0 and extremes[1].item() < 1.0
    gumbel = -torch.log(-torch.log(extremes))
    assert torch.isfinite(gumbel).all()
    logits = torch.full((1, 4), float("-inf"))
    logits[0, 2] = 0.0
    noisy = logits + gumbel.max()
    assert ops.row_argmax(noisy).item() == 2
