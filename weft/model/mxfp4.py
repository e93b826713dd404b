"""MXFP4 blocks (gpt-oss's experts) rewritten exactly as Q5_0 blocks, which weft's CPU kernels
multiply (int8-activation dot panels).

An MXFP4 block is 32 weights: one E8M0 exponent byte e and 16 bytes of 4-bit e2m1 codes (weight j
in the low nibble of byte j, weight j + 16 in the high one). Weight = kvalues[code] * 2^(e - 128),
kvalues the doubled e2m1 values 0, 1, 2, 3, 4, 6, 8, 12 and their negatives (as llama.cpp and
`gguf` read them). A Q5_0 block is the same 32 weights as a float16 scale d and 5-bit codes q,
weight = d * (q - 16): with d = 2^(e - 128) and q = kvalues[code] + 16 (4..28) every weight is the
same number. 5.5 bits a weight instead of 4.25; float16 holds every d from 2^-24 up to 2^15, and
a block whose d is below 2^-24 (weights under 4e-7) becomes zeros, as float16 rounds it.
"""

from __future__ import annotations

import numpy as np

MXFP4_BLOCK_BYTES = 17  # e, then 16 bytes of codes
Q5_0_BLOCK_BYTES = 22  # d (float16), qh (32 high bits), then 16 bytes of low nibbles
KVALUES = np.array([0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12], dtype=np.int16)


def mxfp4_as_q5_0(rows: np.ndarray) -> np.ndarray:  # [..., blocks * 17] uint8 -> [..., blocks * 22]
    """MXFP4 rows of blocks as Q5_0 rows of the same weights (see the module's docstring)."""
    lead, width = rows.shape[:-1], rows.shape[-1]
    if width % MXFP4_BLOCK_BYTES:
        raise ValueError(f"a row of {width} bytes is not whole MXFP4 blocks of {MXFP4_BLOCK_BYTES}")
    blocks = rows.reshape(-1, MXFP4_BLOCK_BYTES)
    exponent = blocks[:, 0].astype(np.int32) - 128  # [N]
    if exponent.max(initial=-128) > 15:
        raise ValueError("an MXFP4 block's scale is above 2^15, past what Q5_0's float16 scale holds")
    codes = np.concatenate([blocks[:, 1:] & 0x0F, blocks[:, 1:] >> 4], axis=1)  # [N, 32]
    q = (KVALUES[codes] + 16).astype(np.uint32)  # [N, 32] in 4..28
    out = np.empty((blocks.shape[0], Q5_0_BLOCK_BYTES), dtype=np.uint8)
    d = np.ldexp(np.float32(1.0), exponent).astype(np.float16)  # exact down to 2^-24, else 0
    out[:, 0:2] = d.reshape(-1, 1).view(np.uint8)
    high = ((q >> 4) & 1) << np.arange(32, dtype=np.uint32)  # [N, 32]: bit j = weight j's fifth bit
    out[:, 2:6] = high.sum(axis=1, dtype=np.uint32).astype("<u4").reshape(-1, 1).view(np.uint8)
    low = (q & 0x0F).astype(np.uint8)
    out[:, 6:] = low[:, :16] | (low[:, 16:] << 4)
    return out.reshape(*lead, width // MXFP4_BLOCK_BYTES * Q5_0_BLOCK_BYTES)
