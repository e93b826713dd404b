"""The communication between tensor-parallel ranks: one torch.distributed process group over
loopback (gloo on CPU, NCCL on CUDA), of its own (no global default group, so that an engine can
be built again in the same process).

The sharded layers use it for their one all-reduce each (the attention's output projection, the
MLP's down projection, the vocabulary-parallel embedding) and the logits' gather on rank 0; rank 0
uses it to hand every step to the other ranks (`send`, `receive`: a pickled message broadcast as
bytes). A collective whose peer died raises at once (gloo: "Connection closed by peer"); a rank
that hangs is caught by the group's timeout.
"""

from __future__ import annotations

import datetime
import pickle
import re
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

DEFAULT_TIMEOUT_S = 1800.0  # a collective waits this long for a rank that hangs (a dead one fails at once)


class RankFailure(RuntimeError):
    """A tensor-parallel rank died or stopped answering; the message says which and why."""


def free_port() -> int:
    """A TCP port free on loopback now, for the group's rendezvous."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _root(options: Any, rank: int = 0) -> Any:
    options.rootRank = rank
    return options


@dataclass(eq=False)
class TensorParallel:
    """This process's place in the group: its `rank` of `world_size`, and the group itself."""

    rank: int
    world_size: int
    device: torch.device
    store: dist.Store
    group: Any  # a ProcessGroupGloo or ProcessGroupNCCL

    @classmethod
    def connect(
        cls,
        rank: int,
        world_size: int,
        port: int,
        device: torch.device,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        failure: Callable[[], str | None] | None = None,
    ) -> TensorParallel:
        """Join the group of `world_size` ranks whose rendezvous is on loopback `port` (rank 0
        serves it); blocks until every rank has joined. Rank 0 asks `failure` (the other ranks'
        processes: which died) while it waits, so that a rank that dies before joining is a
        RankFailure at once, not a timeout."""
        timeout = datetime.timedelta(seconds=timeout_s)
        if rank == 0:
            store = dist.TCPStore(
                "127.0.0.1", port, world_size, True, timeout=timeout, wait_for_workers=False
            )
            _await_ranks(store, world_size, timeout_s, failure)
        else:
            store = dist.TCPStore("127.0.0.1", port, world_size, False, timeout=timeout)
            store.set(f"joined/{rank}", "1")
        if device.type == "cuda":
            group: Any = dist.ProcessGroupNCCL(store, rank, world_size, dist.ProcessGroupNCCL.Options())
        else:
            group = dist.ProcessGroupGloo(store, rank, world_size, timeout)
        return cls(rank, world_size, device, store, group)

    def all_reduce_(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum `tensor` over the ranks, in place; returns it."""
        _wait(self.group.allreduce([tensor]))
        return tensor

    def gather_columns(self, local: torch.Tensor) -> torch.Tensor:
        """[n, v] on each rank -> [n, v * world_size] on rank 0, the ranks' columns side by side
        (the other ranks get their own `local` back)."""
        local = local.contiguous()
        if self.rank != 0:
            _wait(self.group.gather([], [local], _root(dist.GatherOptions())))
            return local
        parts = [torch.empty_like(local) for _ in range(self.world_size)]
        _wait(self.group.gather([parts], [local], _root(dist.GatherOptions())))
        return torch.cat(parts, dim=1)

    def send(self, message: Any) -> None:
        """Rank 0: hand `message` (anything picklable) to every other rank."""
        data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
        size = torch.tensor([len(data)], dtype=torch.int64, device=self._wire)
        self._broadcast(size)
        payload = torch.frombuffer(bytearray(data), dtype=torch.uint8).to(self._wire)
        self._broadcast(payload)

    def receive(self) -> Any:
        """The other ranks: the next message rank 0 sends."""
        size = torch.zeros(1, dtype=torch.int64, device=self._wire)
        self._broadcast(size)
        payload = torch.empty(int(size.item()), dtype=torch.uint8, device=self._wire)
        self._broadcast(payload)
        return pickle.loads(payload.cpu().numpy().tobytes())

    @property
    def _wire(self) -> torch.device:
        return self.device if self.device.type == "cuda" else torch.device("cpu")

    def _broadcast(self, tensor: torch.Tensor) -> None:
        options = _root(dist.BroadcastOptions())
        options.rootTensor = 0
        _wait(self.group.broadcast([tensor], options))


def _await_ranks(
    store: dist.Store, world_size: int, timeout_s: float, failure: Callable[[], str | None] | None
) -> None:
    keys = [f"joined/{rank}" for rank in range(1, world_size)]
    deadline = time.monotonic() + timeout_s
    while not store.check(keys):
        dead = failure() if failure is not None else None
        if dead is not None:
            raise RankFailure(f"{dead} before joining the tensor-parallel group (its error is above)")
        if time.monotonic() > deadline:
            raise RankFailure(f"the tensor-parallel ranks did not join within {timeout_s:.0f} s")
        time.sleep(0.05)


def _wait(work: Any) -> None:
    """Wait for a collective; a peer that died or timed out is a RankFailure."""
    try:
        work.wait()
    except RuntimeError as exc:
        raise RankFailure(_what_happened(str(exc))) from None


def _what_happened(message: str) -> str:
    """gloo's message without its source location and its advice: 'Connection reset by peer'."""
    first = re.sub(r"^\[[^\]]*\] ", "", message.splitlines()[0] if message else "")
    return first.split(". This is typically")[0][:200]
