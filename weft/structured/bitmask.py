"""Token bitmasks: int32 words, bit j of word w allows token 32 * w + j.

Applying one to logits is a device operation: `TorchKernels.apply_token_bitmask_` (weft/kernels.py)
and its native CPU kernel.
"""

from __future__ import annotations

from weft.kernels import unpack_bitmask


def bitmask_words(vocab_size: int) -> int:
    return (vocab_size + 31) // 32


__all__ = ["bitmask_words", "unpack_bitmask"]
