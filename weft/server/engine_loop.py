"""The engine, stepped in one thread, serving requests from an asyncio event loop in another.

The event loop never runs engine code: `EngineLoop.add` queues an add (its result, or the
`ValueError` of a bad request, comes back as a future), `abort` queues an abort, and the engine
thread applies both between two steps, so a new request joins the running batch at the next
step. After each step the engine thread hands every output to the event loop in one call, which
puts each on its request's `asyncio.Queue`. `weft serve` runs the engine in the main thread (see
docs/server.md for why, measured) and the event loop in a second one.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Callable, Iterable
from concurrent.futures import Future
from dataclasses import dataclass, field

from weft.engine.engine import LLMEngine
from weft.outputs import EngineStats, RequestOutput
from weft.params import BeamSearchParams, SamplingParams

log = logging.getLogger("weft.server")


class QueueFull(Exception):
    """More requests in flight than the server accepts (`max_pending`)."""


@dataclass(slots=True)
class _Add:
    request_id: str
    prompt: str | list[int]
    params: SamplingParams | BeamSearchParams
    done: Future[None]


@dataclass(slots=True)
class _Stream:
    queue: asyncio.Queue[RequestOutput | BaseException] = field(default_factory=asyncio.Queue)
    finished: bool = False  # its last output was read
    arrival: float = field(default_factory=time.perf_counter)
    reported: bool = False  # `on_finish` was called for it


class EngineLoop:
    def __init__(self, engine: LLMEngine, max_pending: int = 1024) -> None:
        self.engine = engine
        self.max_pending = max_pending
        self.stats: EngineStats = engine.stats()  # a snapshot, refreshed by the thread after each step
        self._commands: deque[_Add | str] = deque()  # adds, and request ids to abort
        self._wake = threading.Event()
        self._ready = threading.Event()  # the event loop has started
        self._streams: dict[str, _Stream] = {}  # touched by the event loop only
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._stop = False
        # called on the event loop as each request finishes (its last output; None: aborted), with
        # the seconds since it arrived: the server's metrics
        self.on_finish: Callable[[RequestOutput | None, float], None] | None = None

    # ---- life cycle (event loop) ---------------------------------------------------------------

    def start(self, own_thread: bool = True) -> None:
        """Called on the event loop at startup. With `own_thread`, the engine steps in a new
        thread; without, the caller runs `run()` in a thread of its own (`weft serve` runs it in
        the main thread: torch computes a step 20-50% slower in other threads on the machines we
        measured)."""
        self._loop = asyncio.get_running_loop()
        self._ready.set()
        if own_thread:
            self._thread = threading.Thread(target=self.run, name="weft-engine", daemon=True)
            self._thread.start()

    def stop(self) -> None:
        self._stop = True
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=30)

    def run(self, until: threading.Event | None = None) -> None:
        """Step the engine until `stop()` (or until `until` is set), once the event loop started."""
        while not self._ready.wait(timeout=0.5):
            if until is not None and until.is_set():
                return
        self._run(until)

    @property
    def num_in_flight(self) -> int:
        return len(self._streams)

    # ---- requests (event loop) -----------------------------------------------------------------

    async def add(
        self, request_id: str, prompt: str | list[int], params: SamplingParams | BeamSearchParams
    ) -> RequestHandle:
        """Queue a request; returns once the engine has taken it. Raises QueueFull, or the engine's
        ValueError for a bad request (nothing is left queued then)."""
        if len(self._streams) >= self.max_pending:
            raise QueueFull(
                f"{len(self._streams)} requests are in flight, the most this server accepts; retry later"
            )
        stream = self._streams[request_id] = _Stream()
        done: Future[None] = Future()
        self._commands.append(_Add(request_id, prompt, params, done))
        self._wake.set()
        try:
            await asyncio.wrap_future(done)
        except BaseException:  # refused, or this waiter cancelled (then the abort follows the add)
            self._streams.pop(request_id, None)
            self.abort(request_id)
            raise
        return RequestHandle(self, request_id, stream)

    def _close(self, request_id: str) -> None:
        stream = self._streams.pop(request_id, None)
        if stream is not None and not stream.finished:
            self.abort(request_id)
            self._finished(None, stream)

    def _finished(self, output: RequestOutput | None, stream: _Stream) -> None:
        if self.on_finish is not None and not stream.reported:
            stream.reported = True
            self.on_finish(output, time.perf_counter() - stream.arrival)

    def abort(self, request_id: str) -> None:
        self._commands.append(request_id)
        self._wake.set()

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        for output in outputs:
            stream = self._streams.get(output.request_id)
            if stream is not None:
                stream.queue.put_nowait(output)
                if output.finished:
                    self._finished(output, stream)

    def _fail_all(self, error: BaseException) -> None:
        for stream in self._streams.values():
            stream.queue.put_nowait(error)

    # ---- the engine thread ---------------------------------------------------------------------

    def _run(self, until: threading.Event | None) -> None:
        assert self._loop is not None
        while not self._stop and not (until is not None and until.is_set()):
            self._apply_commands()
            if not self.engine.has_unfinished_requests():
                self._wake.wait(timeout=1.0)
                self._wake.clear()
                continue
            try:
                outputs = self.engine.step()
            except Exception as exc:  # a bug: fail what is in flight, keep serving
                log.exception("engine step failed")
                self._abort_everything()
                self._loop.call_soon_threadsafe(self._fail_all, RuntimeError(f"engine step failed: {exc}"))
                continue
            if outputs:
                self._loop.call_soon_threadsafe(self._deliver, outputs)

    def _apply_commands(self) -> None:
        while self._commands:
            command = self._commands.popleft()
            if isinstance(command, str):
                self.engine.abort_request(command)
                continue
            try:
                self.engine.add_request(command.request_id, command.prompt, command.params)
            except Exception as exc:
                command.done.set_exception(exc)
            else:
                command.done.set_result(None)
        self.stats = self.engine.stats()

    def _abort_everything(self) -> None:
        for request_id in list(self.engine.groups):
            self.engine.abort_request(request_id)


class RequestHandle:
    """One request in the engine: iterate its outputs; `close()` (also on leaving the iteration
    early, as when a client goes away) aborts it and frees its blocks at once."""

    def __init__(self, loop: EngineLoop, request_id: str, stream: _Stream) -> None:
        self.loop = loop
        self.request_id = request_id
        self._stream = stream

    async def outputs(self) -> AsyncIterator[RequestOutput]:
        try:
            while True:
                item = await self._stream.queue.get()
                if isinstance(item, BaseException):
                    raise item
                yield item
                if item.finished:
                    self._stream.finished = True
                    return
        finally:
            self.close()

    def close(self) -> None:
        self.loop._close(self.request_id)


def merge(iterators: Iterable[AsyncIterator[RequestOutput]]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Outputs of several requests as they come, each tagged with its request's position."""
    return _merge(list(iterators))


async def _merge(iterators: list[AsyncIterator[RequestOutput]]) -> AsyncIterator[tuple[int, RequestOutput]]:
    queue: asyncio.Queue[tuple[int, RequestOutput] | tuple[int, BaseException] | None] = asyncio.Queue()

    async def pump(index: int, it: AsyncIterator[RequestOutput]) -> None:
        try:
            async for item in it:
                await queue.put((index, item))
        except BaseException as exc:  # handed to the consumer, which raises it
            await queue.put((index, exc))
        finally:
            await queue.put(None)

    tasks = [asyncio.create_task(pump(i, it)) for i, it in enumerate(iterators)]
    try:
        remaining = len(tasks)
        while remaining:
            got = await queue.get()
            if got is None:
                remaining -= 1
                continue
            index, item = got
            if isinstance(item, BaseException):
                raise item
            yield index, item
    finally:  # a consumer that stops early (a client gone) aborts every request still running
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def now() -> int:
    return int(time.time())
