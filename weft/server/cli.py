"""`weft serve`: the OpenAI-compatible server on uvicorn."""

from __future__ import annotations

import argparse
import os
import signal
import threading
from pathlib import Path
from typing import Any

from weft.agents.reasoning import REASONING_FORMATS
from weft.agents.tool_formats import FORMATS
from weft.engine.args import EngineArgs, add_engine_arguments, engine_options
from weft.schema_objects import JsonSchemaMode
from weft.server.engine_loop import EngineLoop


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
    add_engine_arguments(p.add_argument_group("engine options (the keyword arguments of LLM)"))
    p.add_argument("--log-level", default="info", help="uvicorn log level (default: info)")


def run(args: argparse.Namespace) -> int:
    import uvicorn

    from weft.engine.factory import build_engine
    from weft.server.app import ServerConfig, build_app

    engine = build_engine(EngineArgs(**engine_options(args)))
    name = args.served_model_name or (Path(args.model).name if args.model else "weft-default")
    config = ServerConfig(
        model_name=name,
        api_key=args.api_key or os.environ.get("WEFT_API_KEY") or None,
        max_body_bytes=args.max_body_bytes,
        max_pending=args.max_pending,
        json_schema_mode=JsonSchemaMode(args.json_schema_mode),
        tool_call_parser=args.tool_call_parser,
        reasoning_parser=args.reasoning_parser,
        max_stored_responses=args.max_stored_responses,
        engine_thread=False,  # the engine steps in the main thread: see serve_forever
    )
    app = build_app(engine, config)
    server = uvicorn.Server(uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level))
    print(f"weft serve: {name!r} on http://{args.host}:{args.port}/v1", flush=True)
    if not serve_forever(server, app.state.engine_loop):
        print(f"weft serve: could not serve on {args.host}:{args.port} (see the error above)", flush=True)
        return 1
    print("weft serve: stopped after finishing the requests in flight", flush=True)
    return 0


def serve_forever(server: Any, engine_loop: EngineLoop) -> bool:
    """uvicorn's event loop in a thread, the engine in this (main) thread. SIGINT/SIGTERM tell
    uvicorn to stop accepting and drain the requests in flight (a second SIGINT: at once); the
    engine steps until uvicorn has finished. Returns whether uvicorn served at all (False: it
    could not start, e.g. the port was taken)."""
    done = threading.Event()

    def serve() -> None:
        try:
            server.run()
        finally:
            done.set()

    def on_signal(sig: int, frame: object) -> None:
        if server.should_exit and sig == signal.SIGINT:
            server.force_exit = True
        server.should_exit = True

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, on_signal)
    thread = threading.Thread(target=serve, name="weft-http", daemon=True)
    thread.start()
    engine_loop.run(until=done)
    thread.join()
    return bool(server.started)
