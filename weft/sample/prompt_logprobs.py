"""Logprobs of prompt tokens, from the hidden states that predict them.

Only the rows of sequences that asked (`SamplingParams.prompt_logprobs`) are computed, a chunk of
rows at a time, so a long prompt never becomes one [prompt_len, vocab] float32 tensor. The
distribution is the model's own (raw; an SMC particle's forced tokens at its temperature); ranks
and the top-k follow the same rule as for sampled tokens (`TorchKernels.row_logprobs`).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from weft.kernels import TORCH_KERNELS, TorchKernels

CHUNK_ROWS = 256  # rows of logits at a time: 256 x 128k float32 is 128 MiB


def prompt_logprobs(
    hidden: torch.Tensor,  # [N, hidden], the rows that predict the prompt tokens
    targets: torch.Tensor,  # [N] int64, the actual prompt tokens they predict
    num_top: int,
    compute_logits: Callable[[torch.Tensor], torch.Tensor],  # [n, hidden] -> [n, V] float32
    chunk_rows: int = CHUNK_ROWS,
    kernels: TorchKernels = TORCH_KERNELS,
    temperature: torch.Tensor | None = None,  # [N] float32: the rows' distributions at these (None: 1)
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(ids [N, k+1], logprobs [N, k+1], ranks [N]); column 0 is the actual token."""
    parts = []
    for start in range(0, hidden.shape[0], chunk_rows):
        logits = compute_logits(hidden[start : start + chunk_rows])  # [n, V]
        if temperature is not None:
            logits = logits / temperature[start : start + chunk_rows, None]
        parts.append(kernels.row_logprobs(logits, targets[start : start + chunk_rows], num_top))
    ids, values, ranks = zip(*parts, strict=True)
    return torch.cat(ids), torch.cat(values), torch.cat(ranks)
