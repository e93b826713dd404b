"""A tensor-parallel rank other than 0, in its own process (started by `weft.parallel.workers`):
join the group, load this rank's part of the model, size the KV cache as rank 0 says, then run
every step rank 0 sends until it says stop."""

from __future__ import annotations

import os
import sys
import traceback

import torch

from weft.engine.args import EngineArgs
from weft.engine.loading import load
from weft.engine.runner import ModelRunner
from weft.parallel.group import TensorParallel
from weft.parallel.workers import STOP, RankSpec, die_with_parent


def worker_main(spec: RankSpec) -> None:
    """The process of rank `spec.rank`: a failure is printed and exits non-zero (rank 0's next
    collective then fails at once, naming this rank)."""
    die_with_parent()
    torch.set_num_threads(spec.threads)
    try:
        tp = TensorParallel.connect(spec.rank, spec.world_size, spec.port, torch.device(spec.device))
        follow_steps(spec, tp)
    except Exception:
        print(f"weft: tensor-parallel rank {spec.rank} failed:\n{traceback.format_exc()}", file=sys.stderr)
        sys.stderr.flush()
        os._exit(1)


def follow_steps(spec: RankSpec, tp: TensorParallel) -> None:
    """Rank `spec.rank` (a worker process): load this rank's part, size the KV cache as rank 0 says,
    then run every step rank 0 sends until it says stop."""
    args = EngineArgs(**spec.options)
    device = torch.device(spec.device)
    loaded = load(args, spec.path, device, tp)
    cache = tp.receive()
    runner = ModelRunner(loaded.model, loaded.model.config, cache, device, loaded.activations)
    while (message := tp.receive()) != STOP:
        runner.follow(message)
