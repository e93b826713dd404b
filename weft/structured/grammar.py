"""The grammar protocol: what the engine needs from a mask engine, in two levels.

1. A `GrammarBackend` compiles a `StructuredSpec` once per tokenizer into a `CompiledGrammar`
   (cached by spec, compiled on worker threads so that the engine loop never waits for it).
2. Each sequence gets its own `GrammarMatcher` from a compiled grammar: it consumes tokens, fills its
   row of the token bitmask (and those of draft positions), reports forced tokens (fast-forward),
   checks guessed tokens without consuming them, and can be forked or rolled back.

Matchers never raise for grammar errors or for a token the grammar rejects: they enter a sticky
error state (`error` is set), which finishes that one request.

Adding a backend is one module implementing these two protocols.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Protocol

import torch

from weft.params import StructuredSpec


class GrammarError(ValueError):
    """A schema, regex or grammar that the backend rejects; the message is the backend's."""


class CompiledGrammar(Protocol):
    @property
    def spec(self) -> StructuredSpec: ...


class GrammarMatcher(Protocol):
    @property
    def error(self) -> str | None: ...

    @property
    def is_finished(self) -> bool: ...

    def consume(self, token_ids: Sequence[int]) -> bool:
        """Advance over `token_ids`; False (and `error` set) if the grammar rejects one."""
        ...

    def rollback(self, num_tokens: int) -> None: ...

    def validate(self, token_ids: Sequence[int]) -> int:
        """How many of `token_ids`, in turn, the grammar would accept now; changes nothing."""
        ...

    def forced_tokens(self) -> list[int]:
        """Tokens the grammar forces next, safe to append without sampling (may be empty)."""
        ...

    def fork(self) -> GrammarMatcher: ...


class GrammarBackend(Protocol):
    vocab_size: int

    def compile(self, spec: StructuredSpec) -> CompiledGrammar:
        """Compile `spec`; raises GrammarError with the backend's message when it is invalid."""
        ...

    def new_matcher(self, grammar: CompiledGrammar) -> GrammarMatcher: ...

    def fill_bitmask(
        self, matchers: Sequence[tuple[GrammarMatcher, int, Sequence[int]]], bitmask: torch.Tensor
    ) -> None:
        """Fill row `idx` of `bitmask` ([R, ceil(V / 32)] int32, CPU) for each (matcher, idx, drafts),
        and rows `idx + 1 ..` with the masks after each of `drafts` (tokens the grammar accepts,
        `GrammarMatcher.validate`), leaving every matcher as it was: all in one call that does not
        hold the GIL."""
        ...


class GrammarCompiler:
    """Compiles specs on worker threads and caches the results by spec (least recently used out)."""

    def __init__(self, backend: GrammarBackend, num_threads: int = 2, cache_size: int = 512) -> None:
        self.backend = backend
        self.cache_size = cache_size
        self._pool = ThreadPoolExecutor(max_workers=num_threads, thread_name_prefix="weft-grammar")
        self._cache: OrderedDict[StructuredSpec, Future[CompiledGrammar]] = OrderedDict()
        self._lock = threading.Lock()

    def submit(self, spec: StructuredSpec) -> Future[CompiledGrammar]:
        with self._lock:
            future = self._cache.get(spec)
            if future is not None:
                self._cache.move_to_end(spec)
                return future
            future = self._pool.submit(self.backend.compile, spec)
            self._cache[spec] = future
            while len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)
            return future

    def compile(self, spec: StructuredSpec) -> CompiledGrammar:
        """Compile now (or take from the cache); raises GrammarError."""
        return self.submit(spec).result()
