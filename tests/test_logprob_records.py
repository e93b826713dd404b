"""Logprob records kept as the step's host block and built when an output's logprobs are read."""

from __future__ import annotations

import copy
import pickle
import threading

import numpy as np

from weft.logprob_records import LazyPositions, Logprob, LogprobRows, row_refs
from weft.outputs import CompletionOutput

TEXTS = {t: f"<{t}>" for t in range(100)}


def _block(num_rows: int) -> np.ndarray:  # [R, 2 + 2 (k+1)] rows of (rank, extra, ids [3], logprobs [3])
    rows = [[r + 1, -0.25 * r, 10 + r, 20 + r, 30 + r, -1.0 - r, -0.5, -2.0] for r in range(num_rows)]
    return np.array(rows, np.float64)


def test_positions_are_built_on_first_read_and_kept():
    refs = row_refs(_block(3))
    out = CompletionOutput(0, "abc", [10, 11, 12], logprobs=LazyPositions(refs, 1, 3, 2, TEXTS))
    first = out.logprobs
    assert first == [
        {11: Logprob(-2.0, 2, "<11>"), 21: Logprob(-0.5, 1, "<21>"), 31: Logprob(-2.0, 2, "<31>")},
        {12: Logprob(-3.0, 3, "<12>"), 22: Logprob(-0.5, 1, "<22>"), 32: Logprob(-2.0, 2, "<32>")},
    ]
    assert out.logprobs is first  # built once
    assert [(r.logprob, r.extra) for r in refs] == [(-1.0, -0.0), (-2.0, -0.25), (-3.0, -0.5)]


def test_an_output_pickles_and_copies_with_its_logprobs_built():
    out = CompletionOutput(0, "a", [10], logprobs=LazyPositions(row_refs(_block(1)), 0, 1, 1, TEXTS))
    for clone in (pickle.loads(pickle.dumps(out)), copy.copy(out), copy.deepcopy(out)):
        assert isinstance(clone._logprobs, list)  # no pending span (it would carry the tokenizer)
        assert clone == out and clone.logprobs == [
            {10: Logprob(-1.0, 1, "<10>"), 20: Logprob(-0.5, 1, "<20>")}
        ]


def test_rows_read_from_several_threads_at_once_agree():
    """A server's event loop builds records while the engine's thread may read the same block."""
    for _ in range(20):
        rows = LogprobRows(_block(64))
        seen: list[list[int]] = []
        barrier = threading.Barrier(4)

        def read(rows: LogprobRows, barrier: threading.Barrier, seen: list[list[int]]) -> None:
            barrier.wait()
            seen.append([rows.row(i)[0][0] for i in range(64)])

        threads = [threading.Thread(target=read, args=(rows, barrier, seen)) for _ in range(4)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        assert seen == [list(range(10, 74))] * 4
