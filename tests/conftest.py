from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
if not torch.cuda.is_available():  # Triton kernels run on CPU tensors in its interpreter (read at import)
    os.environ.setdefault("TRITON_INTERPRET", "1")
# The prefill GEMM threshold is measured per machine at load; the suite fixes it, so that which path a
# long prompt takes does not depend on the machine (tests/test_prefill_gemm.py measures it).
os.environ.setdefault("WEFT_DENSE_ROWS", "1024")

import background
import other_builds
from checkpoints import build_checkpoint

SHARED_DATA = Path(__file__).resolve().parents[2] / "shared" / "data"

# Devices the numeric tests run weft on, in float32 against the CPU reference: the CPU always, and
# a CUDA GPU where there is one.
DEVICES = ["cpu", *(["cuda"] if torch.cuda.is_available() else [])]


def shared_data(relative: str) -> Path:
    """A path under ../shared/data, or skip the test with the reason when it is absent."""
    path = SHARED_DATA / relative
    if not path.exists():
        pytest.skip(f"{path} is absent: the shared test data (../shared/data beside the checkout) is needed")
    return path


def require_native_kernels() -> None:
    """Skip the calling test when weft's CPU kernels are off or cannot be built; in CI, fail."""
    import weft.native

    if not weft.native.kernels_available():
        if os.environ.get("CI"):
            pytest.fail("the CPU kernels must build in CI (g++ and ninja are expected there)")
        pytest.skip("weft's CPU kernels are off (WEFT_NATIVE=0) or could not be built here")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The tests that await a background job run last, so that the job has the whole session to
    take the CPU the other tests leave idle, and no test waits on it while a core stands still."""
    items.sort(key=lambda item: item.get_closest_marker("background") is not None)  # stable


def pytest_collection_finish(session: pytest.Session) -> None:
    """Start the selected slow subprocess checks now, in the background (tests/background.py)."""
    if session.config.option.collectonly:
        return
    tests = [item for item in session.items if isinstance(item, pytest.Function)]
    if any(item.originalname == "test_mypy_clean" for item in tests):
        background.start("mypy", [sys.executable, "-m", "mypy"])
    if any(item.originalname == "test_a_build_killed_midway_is_redone_by_the_next_process" for item in tests):
        import test_native_build

        background.start(test_native_build.JOB, test_native_build.command())
    name = "test_other_builds_of_the_kernels_pass_the_same_tests"
    selected = {item.callspec.params["path"] for item in tests if item.originalname == name}
    if not selected:
        return
    if os.environ.get(other_builds.CHILD_BUILD) or not other_builds.is_x86():
        return
    import weft.native
    from weft.kernels import cpu_isa_path

    if not weft.native.kernels_available():
        return
    own = cpu_isa_path()
    for path, (_, _, isa, _) in other_builds.BUILDS.items():
        if isa != own and path in selected:
            out = other_builds.cache_dir(path)  # kept: a later session reuses the build
            background.start(f"build-{path}", other_builds.command(path, out))


def pytest_sessionfinish(session: pytest.Session) -> None:
    background.stop_all()


@pytest.fixture(scope="session", autouse=True)
def native_kernels_built():
    """Build weft's CPU kernels once, before any test, so that no test (or `weft` subprocess under a
    timeout) pays the first compile. Tests of both paths switch between them themselves."""
    import weft.native

    weft.native.kernels_available()


@pytest.fixture(scope="session")
def checkpoint_factory(tmp_path_factory: pytest.TempPathFactory):
    cache: dict[tuple, Path] = {}

    def make(arch: str = "llama", **overrides) -> Path:
        key = (arch, repr(sorted(overrides.items())))
        if key not in cache:
            cache[key] = build_checkpoint(tmp_path_factory.mktemp(f"ckpt-{arch}"), arch, **overrides)
        return cache[key]

    return make


@pytest.fixture(scope="session")
def tiny_llama(checkpoint_factory) -> Path:
    return checkpoint_factory("llama")


@pytest.fixture(scope="session")
def bundled_server():
    """`weft serve` on the bundled model (test_server's options: `--max-pending 256`), one for the
    server, Responses and Messages tests: each checks its own requests, never the server's totals."""
    from test_server import Server

    server = Server("--max-pending", "256")
    yield server
    server.stop()


@pytest.fixture(scope="session")
def qwen_chat(tmp_path_factory: pytest.TempPathFactory):
    """A tiny random model over the Qwen2.5 tokenizer (its template: Hermes-style tool calls), and
    `weft serve` on it as "chat" with a 16k context (room for Codex CLI's first request): one
    server for the tool-call and Responses tests. Yields (checkpoint, server)."""
    from checkpoints import build_chat_checkpoint
    from test_server import Server

    out = build_chat_checkpoint(
        tmp_path_factory.mktemp("qwen-chat"), shared_data("tokenizers/qwen2.5"), max_positions=16384
    )
    server = Server("--model", str(out), "--served-model-name", "chat", "--max-model-len", "16384")
    yield out, server
    server.stop()


@pytest.fixture(autouse=True)
def no_leaks(request: pytest.FixtureRequest):
    """After a test that used the module's `llm`, every request is gone and every KV block is free."""
    yield
    if "llm" not in request.fixturenames:
        return
    stats = request.getfixturevalue("llm").stats()
    assert stats["kv_blocks_used"] == 0, "KV blocks leaked"
    assert stats["num_running"] == 0 and stats["num_waiting"] == 0, "sequences left in the scheduler"
    assert stats["num_parked"] == 0, "parked beams left"
    assert not request.getfixturevalue("llm").engine.has_unfinished_requests(), "requests left"
