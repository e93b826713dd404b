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
"""

from __future__ import annotations

import gc
import os

GEN0_THRESHOLD = 20_000


def settle_heap() -> None:
    if os.environ.get("WEFT_GC_TUNING", "1") == "0":
        return
    gen0, gen1, gen2 = gc.get_threshold()
    if 0 < gen0 < GEN0_THRESHOLD:
        gc.set_threshold(GEN0_THRESHOLD, gen1, gen2)
