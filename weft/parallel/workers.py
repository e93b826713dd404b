"""The processes of tensor-parallel ranks 1..N-1.

The engine's factory starts them (`Workers.start`: `torch.multiprocessing` spawn, one process per
rank, each told to die with its parent); each runs `weft.engine.rank.worker_main`: it joins the
group, loads its part of the model (the same loader as rank 0's), receives the KV-cache
configuration rank 0 settled, and then follows every step rank 0 sends (`ModelRunner.follow`)
until it is told to stop. Rank 0 runs the engine: one scheduler, one sampler, one grammar manager.

A worker that fails exits with a non-zero code after printing why; rank 0's next collective then
fails at once (its peer closed the connection), and the engine fails every request with the dead
rank's exit code in the message, stops the other ranks and refuses new requests (`LLMEngine.step`).
"""

from __future__ import annotations

import contextlib
import ctypes
import signal
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.process import BaseProcess
from pathlib import Path
from typing import Any

import torch.multiprocessing as mp

from weft.parallel.group import TensorParallel

STOP = "stop"  # rank 0's last message
JOIN_TIMEOUT_S = 30.0


@dataclass(frozen=True, slots=True)
class RankSpec:
    """What a worker needs to load its part of the model (picklable: it crosses the spawn)."""

    rank: int
    world_size: int
    port: int
    device: str  # "cpu", or "cuda:<rank>"
    threads: int  # CPU threads of this rank's kernels
    path: Path  # the resolved checkpoint
    options: dict[str, Any]  # the engine's options (`EngineArgs` fields)


def die_with_parent() -> None:
    """Linux: get SIGKILL when the engine's process dies, so that no rank outlives it."""
    if not sys.platform.startswith("linux"):
        return
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:
        pass


class Workers:
    """Ranks 1..N-1 of a tensor-parallel engine, as processes."""

    def __init__(self, processes: list[BaseProcess]) -> None:
        self.processes = processes
        self.stopped = False

    @classmethod
    def start(cls, specs: list[RankSpec], target: Callable[[RankSpec], None]) -> Workers:
        """One spawned process per spec, running `target(spec)` (`weft.engine.rank.worker_main`)."""
        context = mp.get_context("spawn")
        processes: list[BaseProcess] = []
        for spec in specs:
            process = context.Process(target=target, args=(spec,), daemon=True, name=f"weft-tp{spec.rank}")
            process.start()
            processes.append(process)
        return cls(processes)

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.processes if p.pid is not None]

    def failure(self, wait_s: float = 0.0) -> str | None:
        """Which ranks died and how, or None while all live (waiting up to `wait_s` for a death
        that a failed collective suggests, as the process may not have been reaped yet)."""
        deadline = time.monotonic() + wait_s
        while all(p.is_alive() for p in self.processes) and time.monotonic() < deadline:
            time.sleep(0.01)
        dead = [(i + 1, p.exitcode) for i, p in enumerate(self.processes) if not p.is_alive()]
        if not dead:
            return None
        return ", ".join(f"rank {rank} {_exit(code)}" for rank, code in dead)

    def stop(self, tp: TensorParallel | None = None) -> None:
        """Tell every rank to stop (when all are alive and `tp` can still reach them), wait for
        them, and kill any that does not exit in time. Safe to call more than once."""
        if self.stopped:
            return
        self.stopped = True
        if tp is not None and self.failure() is None:
            with contextlib.suppress(RuntimeError):  # a rank died meanwhile: it is killed below
                tp.send(STOP)
        for process in self.processes:
            process.join(JOIN_TIMEOUT_S if self.failure() is None else 1.0)
        for process in self.processes:
            if process.is_alive():
                process.kill()
                process.join(JOIN_TIMEOUT_S)


def _exit(code: int | None) -> str:
    if code is not None and code < 0:
        return f"was killed by signal {-code} ({signal.Signals(-code).name})"
    return f"exited with code {code}"
