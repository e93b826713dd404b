"""Token bitmasks: int32 words, bit j of word w allows token 32 * w + j."""

from __future__ import annotations

import torch

from weft.native import use_kernels


def bitmask_words(vocab_size: int) -> int:
    return (vocab_size + 31) // 32


def unpack_bitmask(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[R, W] int32 -> [R, vocab_size] bool, True = allowed."""
    shifts = torch.arange(32, dtype=torch.int32, device=bitmask.device)  # [32]
    bits = (bitmask.unsqueeze(-1) >> shifts) & 1  # [R, W, 32]
    return bits.view(bitmask.shape[0], -1)[:, :vocab_size].bool()


def apply_bitmask_inplace(logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor | None) -> None:
    """Set disallowed logits to -inf, in place, for the masked rows only.

    logits: [B, V] float32; bitmask: [R, ceil(V / 32)] int32 (on any device; moved to the logits');
    rows: [R] int64, the logits row of each bitmask row, or None when R == B (row i is row i).
    Rows not listed are untouched. No Python loop over rows or over the vocabulary: on CPU one
    native kernel call (`weft/native`), which skips words that allow all or none of their tokens;
    elsewhere the bits are unpacked with tensor operations.
    """
    if logits.dtype == torch.float32 and bitmask.device == logits.device and use_kernels(logits.device):
        empty = torch.empty(0, dtype=torch.int64)
        torch.ops.weft.apply_token_bitmask_(logits, bitmask, empty if rows is None else rows)
        return
    allowed = unpack_bitmask(bitmask.to(logits.device, non_blocking=True), logits.shape[-1])  # [R, V]
    if rows is None:
        logits.masked_fill_(~allowed, float("-inf"))
    else:
        logits[rows] = logits[rows].masked_fill(~allowed, float("-inf"))
