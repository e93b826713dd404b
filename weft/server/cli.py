"""`weft serve`: the OpenAI-compatible server on uvicorn."""

from __future__ import annotations

import argparse
import os
import signal
import threading
from pathlib import Path
from typing import Any

from weft.config import MATMUL_PRECISION_HELP, MATMUL_PRECISIONS
from weft.model.quantize import QUANTIZATIONS
from weft.server.engine_loop import EngineLoop


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--model", default=None, help="checkpoint directory or model id (default: the bundled model)"
    )
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
    engine = p.add_argument_group("engine options (as in LLM)")
    engine.add_argument("--dtype", default=None, help="float32 (CPU default), bfloat16 or float16")
    engine.add_argument(
        "--tokenizer", default=None, help="a Hugging Face tokenizer directory (default: the model's own)"
    )
    engine.add_argument(
        "--matmul-precision", default=None, choices=MATMUL_PRECISIONS, help=MATMUL_PRECISION_HELP
    )
    engine.add_argument(
        "--quantization",
        default=None,
        choices=QUANTIZATIONS,
        help="CPU: quantize a float checkpoint's matrices as it loads (q8_0: llama.cpp's Q8_0 blocks)",
    )
    engine.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    engine.add_argument("--max-model-len", type=int, default=None, help="context length")
    engine.add_argument("--block-size", type=int, default=16, help="tokens per KV-cache block (default: 16)")
    engine.add_argument("--max-num-seqs", type=int, default=64, help="sequences per step (default: 64)")
    engine.add_argument("--max-num-batched-tokens", type=int, default=None, help="tokens per step")
    engine.add_argument("--num-kv-blocks", type=int, default=None, help="KV-cache blocks")
    engine.add_argument("--kv-cache-memory-gb", type=float, default=None, help="KV-cache memory")
    engine.add_argument("--no-prefix-caching", action="store_true", help="turn prefix caching off")
    engine.add_argument("--max-logprobs", type=int, default=20, help="most top logprobs a request may ask")
    engine.add_argument("--seed", type=int, default=0, help="engine seed")
    engine.add_argument(
        "--enforce-eager", action="store_true", help="no CUDA graphs: every step runs eagerly (CUDA only)"
    )
    engine.add_argument(
        "--async-scheduling",
        choices=["on", "off"],
        default=None,
        help="schedule the next step before this one's tokens are read back (default: on for CUDA)",
    )
    p.add_argument("--log-level", default="info", help="uvicorn log level (default: info)")


def run(args: argparse.Namespace) -> int:
    import uvicorn

    from weft.engine.factory import EngineArgs, build_engine
    from weft.server.app import ServerConfig, build_app

    engine = build_engine(
        EngineArgs(
            model=args.model,
            tokenizer=args.tokenizer,
            dtype=args.dtype,
            device=args.device,
            max_model_len=args.max_model_len,
            block_size=args.block_size,
            max_num_seqs=args.max_num_seqs,
            max_num_batched_tokens=args.max_num_batched_tokens,
            num_kv_blocks=args.num_kv_blocks,
            kv_cache_memory_gb=args.kv_cache_memory_gb,
            enable_prefix_caching=not args.no_prefix_caching,
            max_logprobs=args.max_logprobs,
            seed=args.seed,
            enforce_eager=args.enforce_eager,
            async_scheduling=None if args.async_scheduling is None else args.async_scheduling == "on",
            matmul_precision=args.matmul_precision,
            quantization=args.quantization,
        )
    )
    name = args.served_model_name or (Path(args.model).name if args.model else "weft-default")
    config = ServerConfig(
        model_name=name,
        api_key=args.api_key or os.environ.get("WEFT_API_KEY") or None,
        max_body_bytes=args.max_body_bytes,
        max_pending=args.max_pending,
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
