"""Pure, batched logits operations. Every function works on all rows at once, each row with its
own parameters; none loops over rows or over the vocabulary in Python."""

from __future__ import annotations

import torch

# splitmix64 constants as signed int64 (torch has no uint64 arithmetic).
_GOLDEN = 0x9E3779B97F4A7C15 - (1 << 64)
_MIX1 = 0xBF58476D1CE4E5B9 - (1 << 64)
_MIX2 = 0x94D049BB133111EB - (1 << 64)
_SEED_MUL = 0x2545F4914F6CDD1D
_POS_MUL = 0x5851F42D4C957F2D


def _shr(x: torch.Tensor, bits: int) -> torch.Tensor:
    """Logical right shift of int64 values (torch's >> is arithmetic)."""
    return (x >> bits) & ((1 << (64 - bits)) - 1)


def keyed_uniform(seeds: torch.Tensor, positions: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Uniform noise in (0, 1), [B, V] float32, that depends only on (seed, position, token id).

    A counter-based generator (splitmix64 over the key) instead of a stateful one: a row's noise
    does not depend on which other rows share the batch, or on how often anything was sampled
    before, so a seeded request samples the same tokens in any batch.
    seeds, positions: [B] int64.
    """
    token_ids = torch.arange(vocab_size, device=seeds.device, dtype=torch.int64)  # [V]
    key = seeds[:, None] * _SEED_MUL + positions[:, None] * _POS_MUL  # [B, 1]
    z = key + (token_ids[None, :] + 1) * _GOLDEN  # [B, V]
    z = (z ^ _shr(z, 30)) * _MIX1
    z = (z ^ _shr(z, 27)) * _MIX2
    z = z ^ _shr(z, 31)
    return bits_to_uniform(_shr(z, 64 - UNIFORM_BITS))  # [B, V]


# 23 bits: (2^23 - 0.5) / 2^23 is a float32 below 1. With 24, the top value rounded to exactly 1.0,
# whose Gumbel noise is +inf: on a token the grammar masked (-inf) that made NaN, which the argmax
# picked, sampling a forbidden token about once in 16 million draws.
UNIFORM_BITS = 23


def bits_to_uniform(bits: torch.Tensor) -> torch.Tensor:
    """int64 values in [0, 2^UNIFORM_BITS) -> float32 strictly inside (0, 1)."""
    return (bits.to(torch.float32) + 0.5) * (1.0 / (1 << UNIFORM_BITS))


def gumbel_sample(logits: torch.Tensor, seeds: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """Sample one token per row from softmax(logits) with the Gumbel-max trick: [B, V] -> [B] int64."""
    uniform = keyed_uniform(seeds, positions, logits.shape[-1])
    gumbel = -torch.log(-torch.log(uniform))
    return row_argmax(logits + gumbel)


def row_argmax(x: torch.Tensor) -> torch.Tensor:
    """[B, V] -> [B] int64, the first index of each row's maximum. `max(dim).indices` has the same
    first-index rule as `argmax` and measured 2.8x faster on CPU (32 x 49152: 0.43 vs 1.22 ms)."""
    return x.max(dim=-1).indices


def apply_penalties(
    logits: torch.Tensor,  # [B, V] float32, modified in place
    prompt_ids: torch.Tensor,  # [B, Lp] int64, padded with V
    output_ids: torch.Tensor,  # [B, Lo] int64, padded with V
    repetition: torch.Tensor,  # [B] float32, 1 = off
    presence: torch.Tensor,  # [B] float32, 0 = off
    frequency: torch.Tensor,  # [B] float32, 0 = off
) -> torch.Tensor:
    """Repetition penalty over prompt and output tokens (as in CTRL / Hugging Face: positive logits
    divided, negative multiplied); presence and frequency penalties over output tokens (as in the
    OpenAI API)."""
    num_rows, vocab_size = logits.shape
    counts = torch.zeros(num_rows, vocab_size + 1, device=logits.device)
    counts.scatter_add_(1, output_ids, torch.ones_like(output_ids, dtype=counts.dtype))
    counts = counts[:, :vocab_size]  # [B, V] occurrences in the output
    in_prompt = torch.zeros(num_rows, vocab_size + 1, dtype=torch.bool, device=logits.device)
    in_prompt.scatter_(1, prompt_ids, True)
    seen = in_prompt[:, :vocab_size] | (counts > 0)  # [B, V]
    rep = repetition[:, None].expand_as(logits)
    penalized = torch.where(logits > 0, logits / rep, logits * rep)
    logits.copy_(torch.where(seen, penalized, logits))
    logits -= frequency[:, None] * counts + presence[:, None] * (counts > 0).to(logits.dtype)
    return logits


def apply_top_k(logits: torch.Tensor, top_k: torch.Tensor, max_k: int) -> torch.Tensor:
    """Keep each row's `top_k` largest logits (top_k [B] int64, 0 = keep all; `max_k` the largest
    effective k, known on the host, so nothing is read back from the device). Tokens tied with the
    k-th logit are all kept: a cut-off that falls inside a tie keeps the whole tie, so the result
    does not depend on the order of equal values."""
    vocab_size = logits.shape[-1]
    k = torch.where(top_k > 0, top_k, vocab_size).clamp(max=vocab_size)  # [B]
    max_k = min(max_k, vocab_size)
    top_values = torch.topk(logits, max_k, dim=-1).values  # [B, max_k]
    kth = top_values.gather(1, (k - 1)[:, None])  # [B, 1]
    return logits.masked_fill(logits < kth, float("-inf"))


def apply_top_p(logits: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Nucleus filtering: keep the smallest set of most likely tokens whose probability reaches
    `top_p` ([B] float32, 1 = keep all), and every token tied with the least likely of them (a
    token stays iff the mass of the tokens strictly more likely is below top_p). The most likely
    token is always kept. The mass is summed in float64: over a 128k vocabulary a float32 cumsum
    moved the cut by thousands of tokens."""
    sorted_logits = torch.sort(logits, dim=-1, descending=True).values  # [B, V]
    probs = sorted_logits.double().softmax(dim=-1)
    mass_before = probs.cumsum(dim=-1) - probs  # [B, V] probability of the better-placed tokens
    remove_sorted = mass_before >= top_p.double()[:, None]
    remove_sorted[:, 0] = False
    smallest_kept = sorted_logits.masked_fill(remove_sorted, float("inf")).amin(
        dim=-1, keepdim=True
    )  # [B, 1]
    return logits.masked_fill(logits < smallest_kept, float("-inf"))


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Drop tokens whose probability is below `min_p` ([B], 0 = off) times the row's top probability."""
    probs = logits.softmax(dim=-1)  # [B, V]
    threshold = probs.amax(dim=-1, keepdim=True) * min_p[:, None]
    return logits.masked_fill(probs < threshold, float("-inf"))
