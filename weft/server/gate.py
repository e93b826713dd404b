"""What a router sees of a replica while it cannot serve: the ASGI app `weft serve` listens with.

`weft serve` binds its port before it loads the model, so that a router (or any health check)
finds the replica at once and learns it is not ready yet; and on SIGTERM it drains instead of
closing: the requests in flight finish while new ones are turned away, so that a router moves
them to another replica. The gate answers, by phase:

| phase | /health | /v1 generation (POST) | everything else |
|---|---|---|---|
| loading | 503 `{"status": "loading"}` | 503 | 503 |
| ready | the app's (200 `{"status": "ok"}`) | the app's | the app's |
| draining | 503 `{"status": "draining"}` | 503 | the app's (/metrics, /v1/models) |

Once the last request in flight has finished while draining, the gate calls `on_drained` (the
server then exits).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from contextlib import AbstractAsyncContextManager
from enum import StrEnum
from typing import Any

from starlette.applications import Starlette
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Receive, Scope, Send

from weft.server.bodies import error_body


class Phase(StrEnum):
    LOADING = "loading"
    READY = "ready"
    DRAINING = "draining"


class Gate:
    def __init__(self) -> None:
        self.phase = Phase.LOADING
        self.app: ASGIApp | None = None
        self.num_in_flight = 0  # requests the app is answering
        self.on_drained: Callable[[], None] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._lifespan: AbstractAsyncContextManager[Any] | None = None

    # ---- the phases (from other threads) ------------------------------------------------------

    def open(self, app: Starlette, timeout_s: float = 60.0) -> None:
        """Serve `app` from now on (its startup run on the event loop first); called from the
        thread that built it, once uvicorn is running."""
        if self._loop is None:
            raise RuntimeError("the server's event loop has not started")
        future = asyncio.run_coroutine_threadsafe(self._start(app), self._loop)
        future.result(timeout_s)

    def drain(self, on_drained: Callable[[], None]) -> None:
        """Turn new requests away and call `on_drained` once the ones in flight have finished
        (at once if none is); safe to call from a signal handler."""
        self.on_drained = on_drained
        was = self.phase
        self.phase = Phase.DRAINING
        if was is not Phase.READY or self.num_in_flight == 0:
            on_drained()

    async def _start(self, app: Starlette) -> None:
        self._lifespan = app.router.lifespan_context(app)
        await self._lifespan.__aenter__()
        self.app = app
        if self.phase is Phase.LOADING:
            self.phase = Phase.READY

    # ---- ASGI ---------------------------------------------------------------------------------

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            return await self._lifespan_events(receive, send)
        if scope["type"] != "http":
            return None
        if self.app is None or self._turned_away(scope):
            return await self._unavailable(scope)(scope, receive, send)
        self.num_in_flight += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.num_in_flight -= 1
            if self.phase is Phase.DRAINING and self.num_in_flight == 0 and self.on_drained is not None:
                self.on_drained()

    def _turned_away(self, scope: Scope) -> bool:
        if self.phase is Phase.READY:
            return False
        if self.phase is Phase.LOADING:
            return True
        return scope["path"] == "/health" or (scope["method"] == "POST" and scope["path"].startswith("/v1/"))

    def _unavailable(self, scope: Scope) -> JSONResponse:
        if scope["path"] == "/health":
            return JSONResponse({"status": self.phase.value}, status_code=503)
        message = (
            "the model is still loading; retry shortly"
            if self.phase is Phase.LOADING
            else "this server is draining (shutting down); send the request to another replica"
        )
        body = error_body(message, "service_unavailable", code=self.phase.value)
        return JSONResponse(body, status_code=503)

    async def _lifespan_events(self, receive: Receive, send: Send) -> None:
        """uvicorn's startup and shutdown: the event loop noted at startup; at shutdown, the app's
        own shutdown (its engine loop stopped)."""
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                self._loop = asyncio.get_running_loop()
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                if self._lifespan is not None:
                    await self._lifespan.__aexit__(None, None, None)
                await send({"type": "lifespan.shutdown.complete"})
                return
