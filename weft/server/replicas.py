"""`weft serve --data-parallel-size N`: N replicas of the server on one host behind a router.

weft does not route: it starts N `weft serve` processes on free loopback ports (the cores split
between them: `OMP_NUM_THREADS`), each a whole engine of its own, and `vllm-router` (a Rust router
from the package index, `pip install vllm-router`) in front of them on `--host`/`--port`, with
`--router-policy` (default cache_aware: a request goes to the replica whose prefix cache holds the
longest part of its prompt, balanced against load). A replica answers /health with 503 while it
loads and drains (weft/server/gate.py), so the router sends it nothing then. SIGTERM (or SIGINT)
drains every replica, then stops the router. Replicas on several machines: run `weft serve` on
each and `vllm-router --worker-urls ...` in front (docs/server.md).
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Sequence

import httpx

from weft.parallel.group import free_port

ROUTER = "vllm-router"
POLICIES = ("cache_aware", "round_robin", "power_of_two", "random", "consistent_hash")
REPLICA_START_TIMEOUT_S = 600.0
# options of this process that the replicas must not get (each replica has its own port)
_OWN = {"--data-parallel-size", "--router-policy", "--port", "--host"}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--data-parallel-size",
        type=int,
        default=1,
        help=f"replicas of the server on this host behind {ROUTER}, the cores split between them "
        "(default: 1)",
    )
    p.add_argument(
        "--router-policy",
        choices=POLICIES,
        default="cache_aware",
        help=f"how {ROUTER} picks a replica with --data-parallel-size (default: cache_aware)",
    )


def run(args: argparse.Namespace, argv: Sequence[str]) -> int:
    """Start the replicas (`argv`: this command's options, passed on to each), wait until each
    answers /health, start the router in front; on SIGTERM or SIGINT drain the replicas, then
    stop the router. Returns the exit code."""
    router = shutil.which(ROUTER)
    if router is None:
        raise SystemExit(f"weft serve: --data-parallel-size needs {ROUTER} on the PATH: pip install {ROUTER}")
    n = args.data_parallel_size
    threads = max(1, (os.cpu_count() or 1) // n)
    ports = [free_port() for _ in range(n)]
    replicas = [_start_replica(argv, port, threads) for port in ports]
    stopping = _on_signals(replicas)
    try:
        urls = [f"http://127.0.0.1:{port}" for port in ports]
        for i, (url, replica) in enumerate(zip(urls, replicas, strict=True)):
            _await_health(url, replica)
            print(f"weft serve: replica {i} (pid {replica.pid}) on {url}", flush=True)
        command = [router, "--host", args.host, "--port", str(args.port), "--worker-urls", *urls]
        command += ["--policy", args.router_policy, "--log-level", "warning"]
        command += ["--prometheus-port", str(free_port())]  # its own metrics: not a fixed port
        router_process = subprocess.Popen(command)
        print(
            f"weft serve: {n} replicas behind {ROUTER} ({args.router_policy}) on {args.host}:{args.port}",
            flush=True,
        )
        return _supervise(router_process, replicas, stopping)
    finally:
        _stop(replicas)


def replica_argv(argv: Sequence[str], port: int) -> list[str]:
    """`argv` without this process's own options, with the replica's port on loopback."""
    out: list[str] = []
    skip = False
    for item in argv:
        if skip:
            skip = False
            continue
        name = item.split("=", 1)[0]
        if name in _OWN:
            skip = "=" not in item
            continue
        out.append(item)
    return [*out, "--host", "127.0.0.1", "--port", str(port)]


def _start_replica(argv: Sequence[str], port: int, threads: int) -> subprocess.Popen[bytes]:
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    return subprocess.Popen([sys.executable, "-m", "weft", "serve", *replica_argv(argv, port)], env=env)


def _await_health(url: str, replica: subprocess.Popen[bytes]) -> None:
    deadline = time.monotonic() + REPLICA_START_TIMEOUT_S
    while time.monotonic() < deadline:
        if replica.poll() is not None:
            raise SystemExit(f"weft serve: the replica on {url} exited with code {replica.returncode}")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise SystemExit(f"weft serve: the replica on {url} was not ready in {REPLICA_START_TIMEOUT_S:.0f} s")


def _on_signals(replicas: list[subprocess.Popen[bytes]]) -> list[bool]:
    """SIGTERM / SIGINT: drain every replica (each finishes what it holds, then exits)."""
    stopping = [False]

    def on_signal(sig: int, frame: object) -> None:
        stopping[0] = True
        for replica in replicas:
            if replica.poll() is None:
                replica.send_signal(signal.SIGTERM)

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, on_signal)
    return stopping


def _supervise(
    router: subprocess.Popen[bytes], replicas: list[subprocess.Popen[bytes]], stopping: list[bool]
) -> int:
    """Run until told to stop (then: once the replicas have drained, stop the router) or until the
    router exits. A replica that dies meanwhile is routed around by the router's health checks."""
    while True:
        if router.poll() is not None:
            return router.returncode
        if stopping[0] and all(r.poll() is not None for r in replicas):
            router.terminate()
            router.wait(30)
            return 0
        time.sleep(0.2)


def _stop(replicas: list[subprocess.Popen[bytes]]) -> None:
    for replica in replicas:
        if replica.poll() is None:
            replica.send_signal(signal.SIGTERM)
    for replica in replicas:
        try:
            replica.wait(60)
        except subprocess.TimeoutExpired:
            replica.kill()
