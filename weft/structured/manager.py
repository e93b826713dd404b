"""Grammar work for the engine: compilation off the loop, and the bitmask of each step.

One step, for the constrained rows of the batch:
  1. `start_fill` fills their bitmask rows on a worker thread (the backend releases the GIL), started
     before the forward pass so the two overlap;
  2. the sampler calls the returned fill's `apply` after the forward pass: it joins the worker and
     masks those logits rows in place, in one operation.
Matchers belong to their sequences; this manager keeps no per-sequence state.
"""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch

from weft.kernels import TorchKernels
from weft.params import StructuredSpec
from weft.structured.bitmask import bitmask_words
from weft.structured.grammar import (
    CompiledGrammar,
    GrammarBackend,
    GrammarCompiler,
    GrammarError,
    GrammarMatcher,
)


@dataclass(frozen=True, slots=True)
class PendingFill:
    """A bitmask being filled for some rows of this step's logits."""

    future: Future[None]
    bitmask: torch.Tensor  # [R, W] int32, CPU
    rows: torch.Tensor | None  # [K] int64 logits rows, None when every row is constrained
    kernels: TorchKernels
    kept: torch.Tensor | None = None  # [K] int64: the bitmask rows that have logits rows (None: all)

    def apply(self, logits: torch.Tensor) -> None:
        """Wait for the fill, then mask the constrained rows of `logits` ([B, V]) in place."""
        self.future.result()
        rows = None if self.rows is None else self.rows.to(logits.device)
        bitmask = self.bitmask if self.kept is None else self.bitmask.index_select(0, self.kept)
        self.kernels.apply_token_bitmask_(logits, bitmask, rows)


class GrammarManager:
    def __init__(
        self,
        backend: GrammarBackend,
        max_num_rows: int,
        kernels: TorchKernels,
        num_compile_threads: int = 2,
        pin_memory: bool = False,
    ) -> None:
        self.backend = backend
        self.kernels = kernels  # applies the mask on the logits' device
        self.compiler = GrammarCompiler(backend, num_compile_threads)
        # A pinned buffer lets the copy to a GPU run without blocking. Refilling it next step is safe:
        # the step's one transfer to the host waits for the stream, and so for that copy.
        self.pin_memory = pin_memory
        self._bitmask = self._new_bitmask(max_num_rows)
        self._filler = ThreadPoolExecutor(max_workers=1, thread_name_prefix="weft-bitmask")

    def _new_bitmask(self, num_rows: int) -> torch.Tensor:  # [R, W] int32, CPU
        words = bitmask_words(self.backend.vocab_size)
        return torch.full((num_rows, words), -1, dtype=torch.int32, pin_memory=self.pin_memory)

    def submit(self, spec: StructuredSpec) -> Future[CompiledGrammar]:
        """Compile `spec` on a worker thread (or take it from the cache)."""
        return self.compiler.submit(spec)

    def validate(self, spec: StructuredSpec) -> None:
        """Compile now (cached); raises GrammarError with the backend's message."""
        self.compiler.compile(spec)

    def new_matcher(self, grammar: CompiledGrammar) -> GrammarMatcher:
        return self.backend.new_matcher(grammar)

    def start_fill(
        self, constrained: Sequence[tuple[int, GrammarMatcher, Sequence[int], Sequence[int]]], num_rows: int
    ) -> PendingFill | None:
        """Begin filling the bitmask for the constrained rows of a step of `num_rows` logits rows:
        for each, in row order, (its logits row, its matcher, its drafts, its rowless draft
        positions) (`StepLayout.grammar_rows`). A matcher's row is followed in the logits by one row
        per draft, each masked as the grammar stands after the drafts before it, but for the draft
        positions in its rowless entry (a grammar forces their tokens: their masks are filled, then
        dropped)."""
        if not constrained:
            return None
        num_mask_rows = sum(1 + len(d) for _, _, d, _ in constrained)
        if num_mask_rows > self._bitmask.shape[0]:  # never index past the rows: grow instead
            self._bitmask = self._new_bitmask(num_mask_rows)
        bitmask = self._bitmask[:num_mask_rows]
        items: list[tuple[GrammarMatcher, int, Sequence[int]]] = []  # (matcher, bitmask row, drafts)
        logits_rows: list[int] = []  # of each kept bitmask row
        dropping = any(skipped for *_, skipped in constrained)
        kept: list[int] = []  # where rows are dropped: the bitmask rows with logits rows
        base = 0  # the bitmask row of the next matcher
        for first, matcher, guessed, skipped in constrained:
            items.append((matcher, base, guessed))
            logits_rows.extend(range(first, first + 1 + len(guessed) - len(skipped)))
            if dropping:
                kept.extend(base + j for j in range(1 + len(guessed)) if j not in skipped)
            base += 1 + len(guessed)
        if num_mask_rows > len(constrained):  # draft rows past a draft the grammar ends at stay unwritten
            bitmask.fill_(-1)
        future = self._filler.submit(self.backend.fill_bitmask, items, bitmask)
        rows = None if num_mask_rows == num_rows and not dropping else torch.tensor(logits_rows)
        return PendingFill(future, bitmask, rows, self.kernels, torch.tensor(kept) if dropping else None)


def compile_error(future: Future[CompiledGrammar]) -> str | None:
    """The message of a finished compilation that failed, or None if it succeeded."""
    try:
        future.result()
    except GrammarError as exc:
        return str(exc)
    except Exception as exc:  # a backend bug must fail this request only
        return f"grammar compilation failed: {exc}"
    return None


__all__ = ["GrammarError", "GrammarManager", "PendingFill", "compile_error"]
