"""Slow checks that are a subprocess each (mypy, the kernels' other ISA builds), started as soon as
the session's tests are collected and awaited by their tests: they run at the lowest CPU priority on
what the suite leaves idle (most tests keep one core busy, waiting on servers, tokenizers and Python),
instead of one after another at the end.

`conftest.pytest_collection_finish` calls `start(name, command)` for each job whose test was
selected; the test calls `finish(name)` for its exit status and output. The jobs' output goes to
files, so a chatty job never blocks on a full pipe; every job still running when the session ends
is killed, and the jobs' files (their logs and `scratch` folders) are removed.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TIMEOUT_S = 1200


@dataclass
class Job:
    process: subprocess.Popen[bytes]
    log: Path


_jobs: dict[str, Job] = {}
_logs = Path(tempfile.mkdtemp(prefix="weft-test-jobs-"))


def start(name: str, command: list[str], env: dict[str, str] | None = None) -> None:
    """Start `command` (in the repository's root) unless a job of that name is running or done."""
    if name in _jobs:
        return
    log = _logs / f"{name}.log"
    with log.open("wb") as out:
        process = subprocess.Popen(
            command,
            cwd=ROOT,
            env=env or dict(os.environ),
            stdout=out,
            stderr=subprocess.STDOUT,
            preexec_fn=_lowest_priority,
        )
    _jobs[name] = Job(process, log)


def _lowest_priority() -> None:
    """In the job's process before it runs: the lowest CPU priority, so that the job takes what the
    suite leaves idle and never a core a test is using (a test's threads that share a core with a
    compiler wait for it at every barrier: with both at one priority, tests early in the session ran
    3x slower than alone)."""
    if hasattr(os, "nice"):
        os.nice(19)


def scratch(name: str) -> Path:
    """A folder for the job `name`'s files, removed with the logs when the session ends."""
    folder = _logs / name
    folder.mkdir(exist_ok=True)
    return folder


def started(name: str) -> bool:
    return name in _jobs


def finish(name: str, timeout_s: float = TIMEOUT_S) -> tuple[int, str]:
    """Wait for the job `name`: its exit status and its output (stdout and stderr together)."""
    job = _jobs[name]
    try:
        code = job.process.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        job.process.kill()
        job.process.wait()
        output = job.log.read_text(errors="replace")
        return -1, f"{name}: still running after {timeout_s:.0f} s, killed\n{output}"
    return code, job.log.read_text(errors="replace")


def stop_all() -> None:
    for job in _jobs.values():
        if job.process.poll() is None:
            job.process.kill()
            job.process.wait()
    shutil.rmtree(_logs, ignore_errors=True)
