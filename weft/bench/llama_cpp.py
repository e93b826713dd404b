"""llama.cpp as a benchmark reference, through llama-cpp-python's low-level API: the same token-id
prompts as weft, greedy, every sequence of a batch decoded together in one `llama_decode` a step,
each sequence in a cache stream of its own. llama-cpp-python is not a weft dependency (it builds
llama.cpp from source: `pip install llama-cpp-python`, about 11 minutes on 2 cores; build it on
the machine that runs the benchmark, so that llama.cpp uses that CPU's instructions).
"""

from __future__ import annotations

import ctypes
import re
import time
from pathlib import Path
from typing import Any

import numpy as np

from weft.bench.timing import Timing


def import_llama_cpp() -> Any:
    """The `llama_cpp` module, quiet; a clear error where it is not installed."""
    try:
        import llama_cpp
        import llama_cpp._logger
    except ImportError:
        raise ValueError(
            "the llama.cpp reference needs llama-cpp-python: pip install llama-cpp-python "
            "(or pass --no-reference to measure weft alone)"
        ) from None
    llama_cpp._logger.set_verbose(False)  # its load and context logs would bury the table
    return llama_cpp


# llama.cpp's type of a KV cache of weft's dtype (ggml_type: F32 0, F16 1, BF16 30)
_KV_TYPES = {"float32": 0, "float16": 1, "q8_0": 8, "bfloat16": 30}  # ggml_type


class LlamaCppReference:
    """One GGUF file loaded in llama.cpp. `time` runs a batch of prompts and times it as weft's
    `time_weft` does (the prefill ends when every sequence has its first new token). One context
    is kept, sized for the last batch; a new batch size makes a new one."""

    name = "llama.cpp"

    def __init__(self, path: Path, threads: int, kv_cache_dtype: str = "float16") -> None:
        self.ll = import_llama_cpp()
        self.ll.llama_backend_init()
        params = self.ll.llama_model_default_params()
        self.model = self.ll.llama_model_load_from_file(str(path).encode(), params)
        if not self.model:
            raise ValueError(f"{path}: llama.cpp could not load this file")
        self.n_vocab = self.ll.llama_vocab_n_tokens(self.ll.llama_model_get_vocab(self.model))
        self.threads = threads
        self.kv_type = _KV_TYPES[kv_cache_dtype]  # its default is float16
        self.ctx, self.ctx_shape = None, (0, 0)
        self.kv_bytes: int | None = None  # the context's KV cache, as llama.cpp logs it

    def time(self, prompts: list[list[int]], output_len: int) -> Timing:
        batch, prompt_len = len(prompts), len(prompts[0])
        ctx = self._context(batch, -(-(prompt_len + output_len + 8) // 256) * 256)
        self.ll.llama_memory_clear(self.ll.llama_get_memory(ctx), True)
        start = time.perf_counter()
        tokens = self._decode(ctx, prompts, [0] * batch)
        prefill = time.perf_counter() - start
        for step in range(output_len - 1):
            tokens = self._decode(ctx, [[t] for t in tokens], [prompt_len + step] * batch)
        return Timing(prefill_s=prefill, total_s=time.perf_counter() - start, kv_bytes=self.kv_bytes)

    def close(self) -> None:
        if self.ctx is not None:
            self.ll.llama_free(self.ctx)
            self.ctx = None
        self.ll.llama_model_free(self.model)

    def _context(self, batch: int, seq_len: int) -> Any:  # seq_len: a multiple of 256, as llama.cpp pads
        if self.ctx is not None and self.ctx_shape == (batch, seq_len):
            return self.ctx
        if self.ctx is not None:
            self.ll.llama_free(self.ctx)
        params = self.ll.llama_context_default_params()
        params.n_ctx = batch * seq_len
        params.n_batch = params.n_ubatch = max(512, batch * seq_len)
        params.n_seq_max = batch
        params.n_threads = params.n_threads_batch = self.threads
        params.kv_unified = False  # a cache stream per sequence: each attends over its own tokens only
        params.swa_full = False  # sliding-window layers keep their window only, as llama-server does
        params.type_k = params.type_v = self.kv_type
        params.flash_attn_type = (
            1  # on (its default, auto, turns it on where the backend has it: the CPU does)
        )
        with _LogLines(self.ll) as lines:
            self.ctx, self.ctx_shape = self.ll.llama_init_from_model(self.model, params), (batch, seq_len)
        sizes = [float(m) for m in re.findall(r"llama_kv_cache: size = +([\d.]+) MiB", "".join(lines))]
        self.kv_bytes = int(sum(sizes) * 2**20) if sizes else None
        if not self.ctx:
            raise RuntimeError(f"llama.cpp could not make a context for {batch} x {seq_len} tokens")
        return self.ctx

    def _decode(self, ctx: Any, chunks: list[list[int]], starts: list[int]) -> list[int]:
        """One llama_decode of every sequence's next tokens; the greedy next token of each."""
        ll, total = self.ll, sum(len(c) for c in chunks)
        b = ll.llama_batch_init(total, 0, len(chunks))
        i = 0
        for seq, (chunk, start) in enumerate(zip(chunks, starts, strict=True)):
            for j, token in enumerate(chunk):
                b.token[i], b.pos[i], b.n_seq_id[i] = int(token), start + j, 1
                b.logits[i] = j == len(chunk) - 1
                b.seq_id[i][0] = seq
                i += 1
        b.n_tokens = total
        try:
            if ll.llama_decode(ctx, b) != 0:
                raise RuntimeError("llama_decode failed")
            logits = ctypes.cast(ll.llama_get_logits(ctx), ctypes.POINTER(ctypes.c_float))
            rows = np.ctypeslib.as_array(logits, (len(chunks), self.n_vocab))  # [B, V]
            return rows.argmax(axis=1).tolist()
        finally:
            ll.llama_batch_free(b)


class _LogLines(list):
    """llama.cpp's log lines while in the block (its quiet logger put back after)."""

    def __init__(self, ll: Any) -> None:
        super().__init__()
        self.ll = ll

        @ll.llama_log_callback
        def keep(level: int, text: bytes, user_data: ctypes.c_void_p) -> None:
            self.append(text.decode("utf-8", "replace"))

        self.callback = keep

    def __enter__(self) -> _LogLines:
        self.ll.llama_log_set(self.callback, ctypes.c_void_p(0))
        return self

    def __exit__(self, *exc: object) -> None:
        import llama_cpp._logger

        self.ll.llama_log_set(llama_cpp._logger.llama_log_callback, ctypes.c_void_p(0))
