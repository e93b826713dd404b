"""Replicas behind an existing router: `weft serve --data-parallel-size 2` starts two replicas and
vllm-router in front of them. Round robin reaches both; cache-aware routing sends a repeated
long prompt to the replica that holds its prefix; a killed replica's traffic moves to the other;
SIGTERM drains everything. The router is in the test extra (CI always has it)."""

from __future__ import annotations

import os
import queue
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from serving import await_health

from weft.engine.default_model import bundled_model_path
from weft.parallel.group import free_port

if shutil.which("vllm-router") is None:
    if os.environ.get("CI"):
        pytest.fail("vllm-router must be installed in CI (the test extra installs it)", pytrace=False)
    pytest.skip(
        "vllm-router is not installed (pip install -e '.[test]' installs it)", allow_module_level=True
    )

LONG = [
    "First Citizen:\nBefore we proceed any further, hear me speak. " * 8,
    "MENENIUS:\nEither you must confess yourselves wondrous malicious, or be accused of folly. " * 6,
    "VOLUMNIA:\nI pray you, daughter, sing; or express yourself in a more comfortable sort. " * 6,
]


class Replicas:
    """`weft serve --data-parallel-size 2` with a router policy: the router's URL, each replica's."""

    def __init__(self, policy: str) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        command = [
            sys.executable,
            "-m",
            "weft",
            "serve",
            "--data-parallel-size",
            "2",
            "--router-policy",
            policy,
        ]
        command += ["--port", str(self.port), "--log-level", "warning", "--max-model-len", "512"]
        command += ["--model", str(bundled_model_path())]
        env = {**os.environ, "HF_HUB_OFFLINE": "1"}
        self.process = subprocess.Popen(
            command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )
        self.replicas: list[tuple[int, str]] = []  # (pid, url)
        # every line of the output read on a thread (the router's logs dropped, so that no pipe ever
        # fills), so that a process that hangs without printing still fails at the deadline
        lines: queue.Queue[str] = queue.Queue()
        threading.Thread(target=self._read, args=(lines,), daemon=True).start()
        deadline = time.monotonic() + 240
        while len(self.replicas) < 2:
            try:
                line = lines.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                pytest.fail("weft serve printed no replica line for 240 s")
            assert line, "weft serve exited before both replicas started"
            if "weft serve: replica" in line:  # "weft serve: replica 0 (pid 123) on http://..."
                # (in the line, not at its start: a replica's progress bar may end in "\r" before it)
                pid = int(line.split("(pid ")[1].split(")")[0])
                self.replicas.append((pid, line.rsplit(" ", 1)[1].strip()))
        await_health(self.url, self.process, deadline - time.monotonic(), "weft serve (the router)")

    def _read(self, lines: queue.Queue[str]) -> None:
        """Put each line of the output on `lines` until both replicas are up, then drop the rest;
        an empty line where the output ends."""
        assert self.process.stdout is not None
        for line in self.process.stdout:
            if len(self.replicas) < 2:
                lines.put(line)
        lines.put("")

    def complete(self, prompt: str, max_tokens: int = 4) -> httpx.Response:
        body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
        return httpx.post(f"{self.url}/v1/completions", json=body, timeout=60)

    def stop(self) -> int:
        self.process.send_signal(signal.SIGTERM)
        try:
            return self.process.wait(60)
        finally:
            if self.process.poll() is None:
                self.process.kill()


def metrics(url: str) -> dict[str, float]:
    values = {}
    for family in text_string_to_metric_families(httpx.get(f"{url}/metrics").text):
        for sample in family.samples:
            status = sample.labels.get("status")
            values[sample.name + (f"[{status}]" if status else "")] = sample.value
    return values


def served_in(values: dict[str, float]) -> float:
    return values.get("weft_requests_total[ok]", 0.0)


def cache_hits(values: dict[str, float]) -> float:
    return values.get("vllm:prefix_cache_hits_total", 0.0)


def served(url: str) -> float:
    return served_in(metrics(url))


@pytest.fixture(scope="module")
def round_robin() -> Iterator[Replicas]:
    replicas = Replicas("round_robin")
    yield replicas
    replicas.stop()


def test_round_robin_reaches_both_replicas(round_robin):
    before = [served(url) for _, url in round_robin.replicas]
    for i in range(6):
        assert round_robin.complete(f"ROMEO: {i}").status_code == 200
    after = [served(url) for _, url in round_robin.replicas]
    assert [b - a for a, b in zip(before, after, strict=True)] == [3, 3]


def test_a_killed_replica_moves_its_traffic_to_the_other(round_robin):
    (dead_pid, _), (_, alive) = round_robin.replicas
    before = served(alive)
    os.kill(dead_pid, signal.SIGKILL)
    codes = [round_robin.complete(f"JULIET: {i}").status_code for i in range(6)]
    assert codes == [200] * 6  # nothing was in flight on the killed one: nothing is lost
    assert served(alive) - before == 6


def test_cache_aware_routing_keeps_a_repeated_prefix_on_one_replica():
    replicas = Replicas("cache_aware")
    try:
        urls = [url for _, url in replicas.replicas]
        for prompt in LONG:
            before = [metrics(url) for url in urls]
            for tail in ("A", "B", "C"):
                assert replicas.complete(prompt + tail).status_code == 200
            after = [metrics(url) for url in urls]
            got = [served_in(a) - served_in(b) for b, a in zip(before, after, strict=True)]
            assert sorted(got) == [0, 3], got  # the three went to one replica
            hits = sum(cache_hits(a) - cache_hits(b) for b, a in zip(before, after, strict=True))
            assert hits > 0  # and the second and third found the first's blocks there
        assert replicas.stop() == 0
        for pid, _ in replicas.replicas:
            with pytest.raises(ProcessLookupError):
                os.kill(pid, 0)
    finally:
        if replicas.process.poll() is None:
            replicas.process.kill()


def test_replicas_get_this_commands_options_with_their_own_port():
    from weft.server.replicas import replica_argv

    argv = [
        "--model",
        "m",
        "--data-parallel-size",
        "2",
        "--port=9000",
        "--router-policy",
        "random",
        "-tp",
        "2",
    ]
    assert replica_argv(argv, 1234) == ["--model", "m", "-tp", "2", "--host", "127.0.0.1", "--port", "1234"]
