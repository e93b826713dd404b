"""The Python heap of a running engine: garbage collection out of the step's way.

Python's cyclic garbage collector runs whenever 700 more container objects have been created than
freed, and every tenth and hundredth time it also walks the older generations, which hold the
hundreds of thousands of objects that importing torch and loading a model and a tokenizer created.
An engine step creates thousands of small containers (a logprob record is a dict of tuples per
position per row), many of which live as long as their request. Measured with `weft bench
overhead`'s workload at batch 256 with top-5 logprobs, collections took 18-25 us per row per step,
about half of the host work, in pauses of tens of milliseconds.

`settle_heap()`, called once an engine is built, raises the first generation's threshold to
`GEN0_THRESHOLD` (unless it is higher already), so the collector runs about thirty times less
often; what the steps leave behind is still collected, in fewer passes. On the same workload,
collections fell to ~1 us per row per step. (Freezing the heap after loading, as some engines do,
measured no better here, and would keep a discarded `LLM`'s cycles alive for good.)
`WEFT_GC_TUNING=0` leaves the collector as it was.

The C heap, on CPU: a prefill step allocates and frees tens of MB of activations per layer (32 x
128 tokens of SmolLM2-135M: 16 MB for q/k/v, 6 MB for an MLP chunk's activation). By default glibc
hands such memory back to the OS as it is freed: an allocation above its mmap threshold (128 KB,
raised to the largest one freed so far, at most 32 MB) is unmapped, and the heap's top is trimmed
past its trim threshold (twice that). The next step touches those pages afresh, a page fault and a
zeroed 4 KB page each: measured on a 2-core Zen 4, 5,000 to 176,000 page faults per such prefill
(0.1-0.4 s of system time over the two threads), none with the thresholds `keep_freed_memory()`
sets once a CPU engine is built. The heap then keeps what the largest step needed, as a caching
allocator would, instead of returning it between steps (process-wide, as the collector's setting
is). `WEFT_MALLOC_TUNING=0` leaves malloc as it is, and so does any libc other than glibc.
"""

from __future__ import annotations

import gc
import os

from weft.glibc import glibc

GEN0_THRESHOLD = 20_000
MMAP_THRESHOLD = 256 << 20  # allocations below it come from the heap, and are reused
TRIM_THRESHOLD = 1 << 30  # free memory at the heap's top kept for the next step
_OLD_GLIBC_MMAP_THRESHOLD = 32 << 20  # the most an older glibc accepts (half its heap size)
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # mallopt's parameters (malloc.h)


def settle_heap() -> None:
    if os.environ.get("WEFT_GC_TUNING", "1") == "0":
        return
    gen0, gen1, gen2 = gc.get_threshold()
    if 0 < gen0 < GEN0_THRESHOLD:
        gc.set_threshold(GEN0_THRESHOLD, gen1, gen2)


def keep_freed_memory() -> bool:
    """Raise glibc's mmap and trim thresholds (see the module's doc); whether they were set."""
    if os.environ.get("WEFT_MALLOC_TUNING", "1") == "0":
        return False
    libc = glibc()
    if libc is None:
        return False
    mallopt = libc.mallopt
    if not mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD):
        mallopt(_M_MMAP_THRESHOLD, _OLD_GLIBC_MMAP_THRESHOLD)
    return bool(mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD))
