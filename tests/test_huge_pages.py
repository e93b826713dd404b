"""The packed weights of a CPU load in 2 MB pages (weft/model/huge_pages.py): where the kernel has
transparent huge pages the weights really sit in them, the model computes the same, the tied table
stays one tensor, and WEFT_HUGE_PAGES=0 leaves them where they were."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from conftest import require_native_kernels

from weft import LLM, SamplingParams, bundled_model_path
from weft.model.huge_pages import HugePageArena, huge_pages_setting
from weft.model.layers import Linear

PROMPTS = ["ROMEO:", "To be, or not"]


def huge_kb_backing(address: int) -> int:
    """AnonHugePages (kB) of the mapping of this process that holds `address` (/proc/self/smaps)."""
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and ":" not in head:  # a mapping's first line: "start-end perms ..."
            start, end = (int(v, 16) for v in head.split("-"))
            inside = start <= address < end
        elif inside and line.startswith("AnonHugePages:"):
            return int(line.split()[1])
    raise AssertionError(f"no mapping holds {address:#x}")


def generate(llm: LLM):
    params = SamplingParams(max_tokens=12, temperature=0, logprobs=3)
    return [o.outputs[0] for o in llm.generate(PROMPTS, params, use_tqdm=False)]


@pytest.fixture(scope="module")
def loads():
    """The bundled model loaded with WEFT_HUGE_PAGES=0 and with the default (1)."""
    require_native_kernels()
    loaded = []
    for setting in ("0", "1"):
        with pytest.MonkeyPatch.context() as env:
            env.setenv("WEFT_HUGE_PAGES", setting)
            loaded.append(LLM(str(bundled_model_path()), show_progress=False))
    return tuple(loaded)


def test_the_weights_sit_in_2mb_pages_where_the_kernel_has_them(loads):
    small, huge = loads
    if huge_pages_setting() not in ("always", "madvise"):
        pytest.skip(f"this kernel's transparent huge pages are {huge_pages_setting() or 'absent'}")
    model = huge.engine.model
    matrices = [m.weight for m in model.modules() if isinstance(m, Linear)]  # the layers' and the lm_head
    assert model.huge_page_bytes == sum(w.numel() * w.element_size() for w in matrices)
    assert huge.kernels["pages"] == f"weights in 2 MB pages ({model.huge_page_bytes / 1e6:.0f} MB)"
    assert huge_kb_backing(model.layers[0].attn.qkv.weight.data_ptr()) > 0
    assert model.embed.from_panels and model.embed.weight is model.lm_head.weight  # still one table
    assert "pages" not in small.kernels and small.engine.model.huge_page_bytes == 0


def test_the_model_computes_the_same_in_either_pages(loads):
    small, huge = loads
    for a, b in zip(generate(small), generate(huge), strict=True):
        assert a.token_ids == b.token_ids
        assert [{t: p.logprob for t, p in row.items()} for row in a.logprobs] == [
            {t: p.logprob for t, p in row.items()} for row in b.logprobs
        ]


def test_the_arena_copies_aligned_and_refuses_what_does_not_fit():
    arena = HugePageArena(3 * 1024)
    first = arena.copy(torch.arange(10, dtype=torch.float32))  # 40 bytes
    second = arena.copy(torch.ones(4, 8, dtype=torch.bfloat16))
    assert first.tolist() == list(range(10)) and second.shape == (4, 8) and second.dtype == torch.bfloat16
    assert first.data_ptr() % (2 << 20) == 0 and second.data_ptr() % 64 == 0
    with pytest.raises(ValueError, match="do not fit"):
        arena.copy(torch.zeros(1024))
