"""`weft serve`: the OpenAI-compatible server on uvicorn."""

from __future__ import annotations

import argparse
import os
import signal
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from weft.agents.reasoning import REASONING_FORMATS
from weft.agents.tool_formats import FORMATS
from weft.engine.args import EngineArgs, add_engine_arguments, engine_options
from weft.schema_objects import JsonSchemaMode
from weft.server import replicas
from weft.server.gate import Gate, Phase


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default: 127.0.0.1, loopback only)")
    p.add_argument("--port", type=int, default=8000, help="port (default: 8000)")
    p.add_argument(
        "--api-key", default=None, help="require 'Authorization: Bearer KEY' (default: $WEFT_API_KEY)"
    )
    p.add_argument(
        "--served-model-name", default=None, help="the model name clients use (default: from --model)"
    )
    p.add_argument(
        "--max-pending", type=int, default=1024, help="requests in flight before 503 (default: 1024)"
    )
    p.add_argument(
        "--max-body-bytes", type=int, default=4 << 20, help="largest request body (default: 4 MiB)"
    )
    p.add_argument(
        "--json-schema-mode",
        choices=["closed", "open"],
        default="closed",
        help="objects of a request's JSON Schema that do not say additionalProperties: closed (no keys "
        "beyond their properties, as vLLM) or open (JSON Schema's meaning); a request's strict: true "
        "is OpenAI's strict mode either way (default: closed)",
    )
    p.add_argument(
        "--tool-call-parser",
        choices=[*FORMATS, "none"],
        default=None,
        help="the format of tool calls under tool_choice auto: the model family's (default: detected "
        "from the chat template; none: tool calls are not read from the reply)",
    )
    p.add_argument(
        "--reasoning-parser",
        choices=[*REASONING_FORMATS, "none"],
        default=None,
        help="the reasoning section returned apart as reasoning_content (default: detected from the "
        "chat template; none: the reply is all content)",
    )
    p.add_argument(
        "--max-stored-responses",
        type=int,
        default=1000,
        help="/v1/responses kept in memory for previous_response_id and GET, the oldest dropped first "
        "(default: 1000; 0: none)",
    )
    replicas.add_arguments(p)
    add_engine_arguments(p.add_argument_group("engine options (the keyword arguments of LLM)"))
    p.add_argument("--log-level", default="info", help="uvicorn log level (default: info)")


def run(args: argparse.Namespace) -> int:
    """Steps: bind the port at once (the gate answers 503 "loading"), load the model, serve; on
    SIGTERM (or a first SIGINT) drain: new requests get 503, those in flight finish, then exit."""
    import uvicorn

    gate = Gate()
    server = uvicorn.Server(uvicorn.Config(gate, host=args.host, port=args.port, log_level=args.log_level))
    http = _serve_in_thread(server)
    _wait_started(server, http)
    if not server.started:
        print(f"weft serve: could not serve on {args.host}:{args.port} (see the error above)", flush=True)
        return 1
    name = args.served_model_name or (Path(args.model).name if args.model else "weft-default")
    stop = _on_signals(server, gate)
    try:
        app = _build(args, name)
    except BaseException:
        server.should_exit = True
        http.join()
        raise
    if gate.phase is Phase.DRAINING:  # told to stop while loading
        http.join()
        app.state.engine_loop.engine.shutdown()
        stop()
        print("weft serve: stopped while loading", flush=True)
        return 0
    gate.open(app)
    print(f"weft serve: {name!r} on http://{args.host}:{args.port}/v1", flush=True)
    app.state.engine_loop.run(until=http.done)  # the engine steps in this (main) thread
    http.join()
    app.state.engine_loop.engine.shutdown()  # tensor parallel: the other ranks
    stop()
    print("weft serve: stopped after finishing the requests in flight", flush=True)
    return 0


def _build(args: argparse.Namespace, name: str) -> Any:
    from weft.engine.factory import build_engine
    from weft.server.app import ServerConfig, build_app

    engine = build_engine(EngineArgs(**engine_options(args)))
    config = ServerConfig(
        model_name=name,
        api_key=args.api_key or os.environ.get("WEFT_API_KEY") or None,
        max_body_bytes=args.max_body_bytes,
        max_pending=args.max_pending,
        json_schema_mode=JsonSchemaMode(args.json_schema_mode),
        tool_call_parser=args.tool_call_parser,
        reasoning_parser=args.reasoning_parser,
        max_stored_responses=args.max_stored_responses,
        engine_thread=False,  # the engine steps in the main thread: see `run`
    )
    return build_app(engine, config)


class _HTTPThread(threading.Thread):
    """uvicorn's event loop, in a thread of its own (`done` set when it returns)."""

    def __init__(self, server: Any) -> None:
        super().__init__(name="weft-http", daemon=True)
        self.server = server
        self.done = threading.Event()

    def run(self) -> None:
        try:
            self.server.run()
        finally:
            self.done.set()


def _serve_in_thread(server: Any) -> _HTTPThread:
    thread = _HTTPThread(server)
    thread.start()
    return thread


def _wait_started(server: Any, http: _HTTPThread) -> None:
    while not server.started and not http.done.wait(0.01):
        pass


def _on_signals(server: Any, gate: Gate) -> Callable[[], None]:
    """SIGTERM, or a first SIGINT: drain (the gate turns new requests away; uvicorn exits once the
    last one in flight has finished). A second SIGINT: exit at once. Returns what undoes it."""

    def drained() -> None:
        server.should_exit = True

    def on_signal(sig: int, frame: object) -> None:
        if gate.phase is Phase.DRAINING and sig == signal.SIGINT:
            server.should_exit = server.force_exit = True
            return
        gate.drain(drained)

    previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}

    def restore() -> None:
        for sig, handler in previous.items():
            signal.signal(sig, handler)

    return restore
