"""Quantizing a float checkpoint's matrices as it loads (`LLM(model, quantization="q8_0")`): each
linear weight, read in float, becomes the blocks a GGUF file of that type would hold
(`QuantizedRows`), and from there runs as a GGUF file's matrices do (weft/model/quantized.py):
packed into panels, multiplied with int8 activations by default. Norms, biases and an untied
embedding table stay in float.

Q8_0 blocks are `gguf.quants.quantize`'s, llama.cpp's reference quantizer (quantize_row_q8_0_ref):
per 32 input features d = max |w| / 127 as float16 and q = round(w / d), ties away from zero.
Q4_K blocks are llama.cpp's quantize_row_q4_K_ref (no importance matrix), ported line by line to
weft/native/quant.cpp (`quantize_q4_k`); rows that are not whole super-blocks of 256, and a tied
embedding table (which llama.cpp's Q4_K_M keeps in Q6_K), go to Q8_0.
"""

from __future__ import annotations

import numpy as np
import torch

from weft.config import ConfigError
from weft.model.quantized import QuantizedRows

QUANTIZATIONS = ("q8_0", "q4_k")
_BLOCK = 32  # input features a matrix's rows must hold whole blocks of (Q8_0's; Q4_K falls back to it)
# the linear layers' weights, by Hugging Face name (Mixtral's experts: w1, w3 gate and up, w2 down)
_MATRICES = ("_proj.weight", "lm_head.weight", ".w1.weight", ".w2.weight", ".w3.weight")
_TABLE = "model.embed_tokens.weight"


def check_quantization(value: str | None) -> str | None:
    """`quantization` as given (`LLM`, `--quantization`): None (keep the checkpoint's) or a type."""
    if value is not None and value not in QUANTIZATIONS:
        raise ConfigError(
            f"quantization {value!r} is not supported; use one of {list(QUANTIZATIONS)} "
            "(or leave it unset to run the checkpoint's own weights)"
        )
    return value


def quantizes(name: str, tensor: object, tied: bool) -> bool:
    """Whether the tensor `name` is a matrix that quantizing at load turns into blocks: a linear
    weight, or the embedding table where it is the lm_head's too, with whole blocks of 32."""
    if not isinstance(tensor, torch.Tensor) or tensor.dim() != 2 or tensor.shape[1] % _BLOCK != 0:
        return False
    return name.endswith(_MATRICES) or (tied and name == _TABLE)


def quantize_rows(matrix: torch.Tensor, kind: str) -> QuantizedRows:
    """A float [N, K] matrix as `kind` blocks: uint8 [N, K / 32 * 34] for Q8_0, [N, K / 256 * 144]
    for Q4_K (weft's kernels must be loaded), Q8_0 where Q4_K's super-blocks do not fit."""
    from gguf import GGMLQuantizationType
    from gguf.quants import quantize

    if kind == "q4_k" and matrix.shape[1] % 256 == 0:
        rows = torch.ops.weft.quantize_q4_k(matrix.detach().to(torch.float32).contiguous())
        return QuantizedRows("q4_k", rows)
    kind = "q8_0"
    values = matrix.detach().to(torch.float32).contiguous().numpy()
    blocks = quantize(values, GGMLQuantizationType[kind.upper()])
    return QuantizedRows(kind, torch.from_numpy(np.ascontiguousarray(blocks)))


__all__ = ["QUANTIZATIONS", "check_quantization", "quantize_rows", "quantizes"]
