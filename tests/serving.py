"""Helpers of the tests that start `weft serve` processes."""

from __future__ import annotations

import subprocess
import time

import httpx


def await_health(url: str, process: subprocess.Popen[str], seconds: float, what: str = "weft serve") -> None:
    """Poll `url`/health until it answers 200; RuntimeError when `process` exits first (with what it
    printed, where nobody else reads its output) or when `seconds` pass."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if process.poll() is not None:
            printed = process.stdout.read() if process.stdout and not process.stdout.closed else ""
            raise RuntimeError(f"{what} exited: {printed}")
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            time.sleep(0.2)
    raise RuntimeError(f"{what} did not come up in {seconds:.0f} s")
