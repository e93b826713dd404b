"""Per-request grammar state for the engine: compilation, bitmask filling, token acceptance.

One step, for the constrained rows of the batch:
  1. `start_fill` fills their bitmask rows on a worker thread (the backend releases the GIL), started
     before the forward pass so the two overlap;
  2. `apply` joins it after the forward pass and masks those logits rows in place, in one operation;
  3. `accept` advances each matcher over its sampled token, and `forced_tokens` gives the tokens the
     grammar now forces, to append without sampling (fast-forward).
"""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from enum import Enum

import torch

from weft.params import StructuredSpec
from weft.structured.bitmask import apply_bitmask_inplace, bitmask_words
from weft.structured.grammar import (
    CompiledGrammar,
    GrammarBackend,
    GrammarCompiler,
    GrammarError,
    GrammarMatcher,
)


class Accept(Enum):
    OK = 0
    FINISHED = 1  # the grammar is complete: the request stops
    ERROR = 2  # the matcher failed: the request ends with an error


@dataclass(frozen=True, slots=True)
class PendingFill:
    future: Future[None]
    bitmask: torch.Tensor  # [R, W] int32, CPU
    rows: torch.Tensor | None  # [R] int64 logits rows, None when every row is constrained


class GrammarManager:
    def __init__(self, backend: GrammarBackend, max_num_seqs: int, num_compile_threads: int = 2) -> None:
        self.backend = backend
        self.compiler = GrammarCompiler(backend, num_compile_threads)
        self.pending: dict[str, Future[CompiledGrammar]] = {}
        self.grammars: dict[str, CompiledGrammar] = {}
        self.matchers: dict[str, GrammarMatcher] = {}
        self._bitmask = torch.full((max_num_seqs, bitmask_words(backend.vocab_size)), -1, dtype=torch.int32)
        self._filler = ThreadPoolExecutor(max_workers=1, thread_name_prefix="weft-bitmask")

    # ---- compilation ------------------------------------------------------------------------

    def submit(self, request_id: str, spec: StructuredSpec) -> None:
        self.pending[request_id] = self.compiler.submit(spec)

    def validate(self, spec: StructuredSpec) -> None:
        """Compile now (cached); raises GrammarError with the backend's message."""
        self.compiler.compile(spec)

    def poll(self, wait_s: float = 0.0) -> tuple[list[str], dict[str, str]]:
        """Requests whose grammar is now compiled, and those whose grammar failed (id -> message).
        With `wait_s`, blocks up to that long for the first pending one."""
        if wait_s > 0 and self.pending:
            wait(self.pending.values(), timeout=wait_s, return_when=FIRST_COMPLETED)
        ready, failed = [], {}
        for request_id, future in list(self.pending.items()):
            if not future.done():
                continue
            del self.pending[request_id]
            try:
                grammar = future.result()
            except GrammarError as exc:
                failed[request_id] = str(exc)
                continue
            except Exception as exc:  # a backend bug must fail this request only
                failed[request_id] = f"grammar compilation failed: {exc}"
                continue
            self.grammars[request_id] = grammar
            self.matchers[request_id] = self.backend.new_matcher(grammar)
            ready.append(request_id)
        return ready, failed

    def has_matcher(self, request_id: str) -> bool:
        return request_id in self.matchers

    def fork(self, parent_id: str, child_id: str) -> None:
        """A new sample of the same request starts from the grammar's beginning."""
        self.grammars[child_id] = self.grammars[parent_id]
        self.matchers[child_id] = self.backend.new_matcher(self.grammars[parent_id])

    def remove(self, request_id: str) -> None:
        self.pending.pop(request_id, None)
        self.grammars.pop(request_id, None)
        self.matchers.pop(request_id, None)

    # ---- the step ---------------------------------------------------------------------------

    def start_fill(self, row_request_ids: Sequence[str]) -> PendingFill | None:
        """Begin filling the bitmask for the rows (in logits order) that have a matcher."""
        constrained = [
            (i, self.matchers[rid]) for i, rid in enumerate(row_request_ids) if rid in self.matchers
        ]
        if not constrained:
            return None
        bitmask = self._bitmask[: len(constrained)]
        pairs = [(matcher, k) for k, (_, matcher) in enumerate(constrained)]
        future = self._filler.submit(self.backend.fill_bitmask, pairs, bitmask)
        rows = None if len(constrained) == len(row_request_ids) else torch.tensor([i for i, _ in constrained])
        return PendingFill(future, bitmask, rows)

    def apply(self, logits: torch.Tensor, fill: PendingFill | None) -> None:
        """Wait for the fill, then mask the constrained rows of `logits` ([B, V]) in place."""
        if fill is None:
            return
        fill.future.result()
        rows = None if fill.rows is None else fill.rows.to(logits.device)
        apply_bitmask_inplace(logits, fill.bitmask, rows)

    def accept(self, request_id: str, token_ids: Sequence[int]) -> Accept:
        matcher = self.matchers[request_id]
        if not matcher.consume(token_ids) or matcher.error is not None:
            return Accept.ERROR
        return Accept.FINISHED if matcher.is_finished else Accept.OK

    def forced_tokens(self, request_id: str) -> list[int]:
        matcher = self.matchers[request_id]
        return [] if matcher.is_finished or matcher.error else matcher.forced_tokens()

    def error(self, request_id: str) -> str:
        matcher = self.matchers.get(request_id)
        return (matcher.error if matcher else None) or "the grammar rejected the sampled token"


__all__ = ["Accept", "GrammarError", "GrammarManager", "PendingFill"]
