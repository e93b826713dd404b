"""What loading a GGUF file costs in memory: the file's pages leave the process as their tensors
are packed (they stay in the page cache), an untied quantized table is kept in dot panels rather
than as float32, and the panels go into huge pages as they are packed (weft/model/gguf_file.py,
loader.py, huge_pages.py). The whole-size Qwen3-30B-A3B file is measured in docs/benchmarks.md."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from weft import LLM, SamplingParams
from weft.model.gguf_checkpoint import GgufCheckpoint
from weft.model.gguf_file import GgufFile, release_pages
from weft.model.huge_pages import HugePages, huge_pages_available

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="reads /proc/self/smaps (Linux)")


def _mapped_kb(path: Path) -> int:
    """Resident KB of this process's mappings of `path` (/proc/self/smaps)."""
    total, inside = 0, False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        fields = line.split()
        if fields and "-" in fields[0] and len(fields) >= 5:  # a mapping's header line
            inside = len(fields) >= 6 and fields[-1] == str(path)
        elif inside and fields[0] == "Rss:":
            total += int(fields[1])
    return total


@pytest.fixture(scope="module")
def moe_file(checkpoint_factory, tmp_path_factory) -> tuple[Path, Path]:
    """A random Q4_K_M file of the tiny Qwen3-MoE shape (untied table), one layer, and a tokenizer."""
    from weft.bench.random_gguf import word_level_tokenizer, write_random_gguf

    out = tmp_path_factory.mktemp("moe-gguf")
    config = checkpoint_factory("qwen3moe", tie_word_embeddings=False) / "config.json"
    path = write_random_gguf(config, "q4_k_m", out / "random.gguf", num_layers=1)
    return path, word_level_tokenizer(384, out / "tokenizer")


def test_a_read_tensor_leaves_resident_memory_and_reads_the_same_again(moe_file):
    path, _ = moe_file
    file = GgufFile(path)
    tensor = max(file.tensors, key=lambda t: t.data.nbytes)
    values = np.array(tensor.data)  # read: its pages are mapped in
    touched = _mapped_kb(path)
    assert touched * 1024 >= tensor.data.nbytes * 0.9
    release_pages(tensor.data.ctypes.data, tensor.data.nbytes)
    assert _mapped_kb(path) * 1024 <= touched * 1024 - tensor.data.nbytes + 2 * 4096  # all but its ends
    np.testing.assert_array_equal(tensor.data, values)  # mapped in again from the page cache
    release_pages(values.ctypes.data, values.nbytes)  # a copy: not in a mapping, left alone
    assert np.array_equal(values, np.array(tensor.data))


def test_a_loaded_model_keeps_none_of_the_file_resident(moe_file):
    path, tokenizer = moe_file
    llm = LLM(str(path), tokenizer=str(tokenizer), show_progress=False)
    assert _mapped_kb(path) * 1024 < 0.05 * path.stat().st_size
    (out,) = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
    assert len(out.outputs[0].token_ids) == 4


def test_an_untied_quantized_table_is_looked_up_in_its_own_dot_panels(moe_file):
    """Not a float32 copy of the table (1.2 GB at Qwen3-30B-A3B's 151,936 x 2,048): its rows come
    out of dot panels as gguf dequantizes them."""
    path, tokenizer = moe_file
    llm = LLM(str(path), tokenizer=str(tokenizer), show_progress=False)
    model = llm.engine.model
    assert not llm.config.model.tie_word_embeddings and model.embed.weight is not model.lm_head.weight
    assert model.embed.weight.dtype == torch.int8 and model.embed.from_panels
    checkpoint = GgufCheckpoint(path)
    (table,) = [t for t in checkpoint.reader.tensors if t.name == "token_embd.weight"]
    assert table.tensor_type.name not in ("F32", "F16")
    ids = torch.tensor([0, 1, 7, 200, llm.config.model.vocab_size - 1])
    torch.testing.assert_close(model.embed(ids), checkpoint.dequantized(table)[ids], rtol=0, atol=0)


def test_huge_pages_take_tensors_across_arenas():
    if not huge_pages_available():
        pytest.skip("this kernel gives no transparent huge pages (or WEFT_HUGE_PAGES=0)")
    pages = HugePages(chunk=1 << 20)
    gen = torch.Generator().manual_seed(0)
    tensors = [torch.randn(n, generator=gen) for n in (200_000, 100_000, 300_000, 10)]  # 0.8, 0.4, 1.2 MB
    copies = [pages.copy(t) for t in tensors]
    assert len(pages.arenas) == 3 and pages.bytes == sum(t.numel() * 4 for t in tensors)
    for tensor, copy in zip(tensors, copies, strict=True):
        assert torch.equal(tensor, copy) and copy.data_ptr() % 64 == 0
        assert pages.holds(copy) and not pages.holds(tensor)


def test_a_file_larger_than_the_memory_available_is_refused_before_loading(moe_file, monkeypatch, capsys):
    """Where the kernel reports less memory available than the file holds, `LLM` says so, names both
    sizes and what to do, before reading a tensor; otherwise loading says what it loaded, from how
    many bytes, in how long and what the process holds."""
    from weft.config import ConfigError
    from weft.engine import fit

    path, tokenizer = moe_file
    assert fit.mem_available() is not None and fit.checkpoint_bytes(path) == path.stat().st_size
    monkeypatch.setattr(fit, "mem_available", lambda: path.stat().st_size // 2)
    monkeypatch.setattr("weft.engine.loading.load_model", lambda *a, **k: pytest.fail("loading started"))
    with pytest.raises(
        ConfigError, match=r"GB of weights.*GB available \(MemAvailable\).*smaller quantization"
    ):
        LLM(str(path), tokenizer=str(tokenizer), show_progress=False)
    monkeypatch.undo()
    LLM(str(path), tokenizer=str(tokenizer), show_progress=True)
    line = [x for x in capsys.readouterr().err.splitlines() if x.startswith("weft: loaded")]
    assert len(line) == 1 and path.name in line[0] and " s, " in line[0] and "B resident" in line[0], line
