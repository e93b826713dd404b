"""GGUF files (weft/model/gguf_checkpoint.py, weft/gguf_tokenizer.py): the files llama.cpp's own
converter and quantizer made (../shared/data/gguf), against llama.cpp's recorded outputs on them, the
gguf package's reference dequantization (through transformers' GGUF loader) and the Hugging Face
tokenizer of the same family; and every bad file a clear error."""

from __future__ import annotations

import functools
import json
import shutil
import struct
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from conftest import SHARED_DATA
from llama_cpp_records import teacher_forced_gap

from weft import LLM, SamplingParams
from weft.config import ConfigError
from weft.model.gguf_checkpoint import GgufCheckpoint, GgufError, hf_name, unpermute_rotary_rows
from weft.model.gguf_file import GgufFile
from weft.tokenizer import Tokenizer

SHARED = SHARED_DATA
GGUF_DIR = SHARED / "gguf"
FILES = {"q8_0": "tiny-q8_0.gguf", "q4_k_m": "tiny-q4_k_m.gguf", "q4_0": "tiny-q4_0.gguf"}
# How close transformers' exact float32 dequantization gets to llama.cpp on these files (the
# README there): mean |dlogp| teacher-forced along llama.cpp's tokens, and argmax agreement of 128.
LLAMA_CPP_GAP = {"q8_0": (0.059, 121), "q4_k_m": (0.109, 118), "q4_0": (0.080, 119)}

pytestmark = pytest.mark.skipif(
    not (GGUF_DIR / "llama_cpp_reference.json").is_file(),
    reason="../shared/data/gguf is not here (a user's clone)",
)


@functools.cache
def transformers_load(path: Path) -> torch.nn.Module:
    """transformers' float32 load of a GGUF file (the gguf package's dequantization), once per file:
    the conversion takes seconds, and two tests compare with the Q4_K_M file's. transformers reads
    the file with gguf's reader twice (its config, then its tensors), ~9 s each for a 49k-token
    vocabulary; the second reading is the first's."""
    import gguf
    import transformers

    readers: dict[str, gguf.GGUFReader] = {}

    def read_once(name: str, *args: Any, **kwargs: Any) -> gguf.GGUFReader:
        if name not in readers:
            readers[name] = reader(name, *args, **kwargs)
        return readers[name]

    reader, gguf.GGUFReader = gguf.GGUFReader, read_once  # type: ignore[misc,assignment]
    try:
        return transformers.AutoModelForCausalLM.from_pretrained(
            str(path.parent), gguf_file=path.name, dtype=torch.float32
        ).eval()
    finally:
        gguf.GGUFReader = reader  # type: ignore[misc]


@pytest.fixture(scope="module")
def reference() -> dict:
    return json.loads((GGUF_DIR / "llama_cpp_reference.json").read_text())


@pytest.fixture(scope="module", params=list(FILES))
def gguf_llm(request) -> tuple[str, LLM]:
    return request.param, LLM(str(GGUF_DIR / FILES[request.param]), show_progress=False, max_logprobs=5)


def test_a_gguf_file_is_a_whole_model(gguf_llm):
    """Configuration, tokenizer and chat template from the one file: the SmolLM2 family's tokenizer
    (compared with its Hugging Face tokenizer.json) and its chat template, tied embeddings."""
    name, llm = gguf_llm
    config = llm.engine.config.model
    assert (config.hidden_size, config.num_layers, config.num_heads, config.num_kv_heads) == (256, 2, 4, 2)
    assert (config.intermediate_size, config.vocab_size, config.head_dim) == (768, 49152, 64)
    assert config.tie_word_embeddings and config.rope.theta == 100000.0
    assert llm.kernels["weights"] == "float32"
    if name == "q8_0":  # every matrix, the tied table included, runs from its Q8_0 blocks
        assert llm.kernels["linear"].endswith("Q8_0 for 9 matrices (int8 dot panels)"), llm.kernels
        assert llm.engine.model.embed.weight.dtype == torch.int8
    if name == "q4_k_m":  # the q/k/v fusion mixing Q4_K and Q6_K stays quantized, each part in its own panels
        assert "Q4_K+Q6_K for 1 matrices" in llm.kernels["linear"], llm.kernels
        qkv = [layer.attn.qkv for layer in llm.engine.model.layers]
        assert [len(lin.parts or ()) for lin in qkv] == [0, 2], "the last layer's v is Q6_K (llama.cpp's mix)"
    assert llm.engine.model.stack is not None  # decode steps in one decoder_stack_ call, parts and all
    assert llm.kernels["matmul"].startswith("quantized matrices: int8 activations")
    family = SHARED / "tokenizers" / "smollm2"
    hf = Tokenizer.from_dir(family)
    texts = [
        "Hello world", " Hello, world!", "w048 7tuijk dsdfhu", "нещо на Български", " this is 🦙.cpp",
        "3333333 33 3", "<|im_start|>user\nHi<|im_end|>", "\n\n\t  x  ", "",
    ]  # fmt: skip
    corpus = sorted((SHARED / "corpora").rglob("*.txt"))
    if corpus:
        texts += corpus[0].read_text(encoding="utf-8", errors="replace")[:20000].splitlines()[:200]
    for text in texts:
        assert llm.tokenizer.encode(text) == hf.encode(text), text
    ids = hf.encode("Hello, world! 🦙 нещо")
    assert llm.tokenizer.decode(ids) == hf.decode(ids)
    assert llm.tokenizer.chat_template == hf.chat_template
    assert llm.tokenizer.eos_token == "<|im_end|>" and llm.tokenizer.bos_token == "<|im_start|>"
    messages = [{"role": "user", "content": "Speak!"}]
    assert llm.tokenizer.apply_chat_template(messages) == hf.apply_chat_template(messages)


@pytest.mark.parametrize("precision", ["float32", "int8"])
@pytest.mark.parametrize("name", list(FILES))
def test_gguf_logprobs_are_as_close_to_llama_cpp_as_an_exact_dequantization(name, precision, reference):
    """Teacher-forced along llama.cpp's greedy tokens: weft's logprob of each token and its argmax,
    against llama.cpp's own. Exact products (float32) are at least as close as transformers' exact
    float32 dequantization gets (the differences are llama.cpp's: it rounds the activations to 8
    bits in its products). int8 products round them as llama.cpp does, from activations that differ
    from llama.cpp's in the last bits (its float16 KV cache): measured 0.080 and 0.059 for Q4_K_M and
    Q4_0, closer than exact products get; 0.064 for Q8_0, 9% further (docs/architecture.md,
    "Quantized weights on CPU")."""
    llm = LLM(str(GGUF_DIR / FILES[name]), show_progress=False, max_logprobs=5, matmul_precision=precision)
    gap, agree, count = teacher_forced_gap(llm, reference["prompts"], reference["files"][name])
    bound, min_agree = LLAMA_CPP_GAP[name]
    assert count == 128
    print(f"{name} {precision}: mean |dlogp| {gap:.4f} (exact: {bound}), argmax {agree}/128")
    slack = 1.05 if precision == "float32" else 1.1
    assert gap <= bound * slack and agree >= min_agree, (gap, agree)


def test_gguf_greedy_tokens_follow_llama_cpp_where_it_is_sure(gguf_llm, reference):
    """Greedy generation from each prompt: the same first token as llama.cpp's every time."""
    name, llm = gguf_llm
    prompts = [list(p) for p in reference["prompts"]]
    outs = llm.generate(prompts, SamplingParams(max_tokens=4, temperature=0, ignore_eos=True), use_tqdm=False)
    firsts = [o.outputs[0].token_ids[0] for o in outs]
    assert firsts == [run["tokens"][0] for run in reference["files"][name]]


@pytest.mark.parametrize("name", ["q8_0", "q4_k_m"])
def test_gguf_model_computes_the_reference_dequantized_product(name):
    """With matmul_precision="float32", the logits of a GGUF load equal transformers' load of the
    same file (which dequantizes with the gguf package to float32) within 1e-4: weft computes the
    exactly dequantized model (from the blocks, in exact quantized panels)."""
    pytest.importorskip("transformers")
    path = GGUF_DIR / FILES[name]
    llm = LLM(str(path), show_progress=False, max_logprobs=20, matmul_precision="float32")
    assert "exact quantized panels" in llm.kernels["linear"]
    hf = transformers_load(path)
    ids = [17, 4000, 123, 9000, 48000, 77, 2024, 31337, 5, 6]
    out = llm.generate([ids], SamplingParams(max_tokens=1, prompt_logprobs=20), use_tqdm=False)[0]
    with torch.no_grad():
        logits = hf(torch.tensor([ids])).logits[0].float()
    expected = torch.log_softmax(logits, dim=-1)  # [T, V]
    for pos, entry in enumerate(out.prompt_logprobs[1:], start=1):
        for token, logprob in entry.items():
            assert abs(logprob.logprob - expected[pos - 1, token].item()) <= 1e-4


@pytest.mark.parametrize("bias", [False, True])
def test_a_fusion_in_two_dot_layouts_decodes_in_the_stack_as_layer_by_layer(bias):
    """The Q4_K_M file's q|k|v in its Q4_K and Q6_K parts (each in its own dot panels): decode steps
    in one `decoder_stack_` call give the tokens and logprobs of the layer-by-layer path; also with
    a q|k|v bias (as Qwen2's), each part taking its columns of it."""
    path = str(GGUF_DIR / FILES["q4_k_m"])
    fused, layered = (LLM(path, show_progress=False, max_logprobs=5) for _ in range(2))
    assert any(layer.attn.qkv.parts for layer in fused.engine.model.layers)
    if bias:
        for llm in (fused, layered):
            for i, layer in enumerate(llm.engine.model.layers):
                qkv = layer.attn.qkv
                values = torch.randn(qkv.out_features, generator=torch.Generator().manual_seed(i))
                qkv.bias = torch.nn.Parameter(values, requires_grad=False)
            llm.engine.model.fuse_stack()  # the stack takes the biases
    assert fused.engine.model.stack is not None
    layered.engine.model.stack = None
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, logprobs=3)
    prompts = [[17, 4000, 123, 9000], [48000, 77]]
    outs = [llm.generate(prompts, params, use_tqdm=False) for llm in (fused, layered)]
    for a, b in zip(*outs, strict=True):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert a.outputs[0].logprobs == b.outputs[0].logprobs


def test_int8_products_are_for_quantized_matrices(checkpoint_factory):
    """matmul_precision="int8" names the byte dot product it runs; on a checkpoint without quantized
    matrices it is a clear error."""
    llm = LLM(str(GGUF_DIR / FILES["q4_0"]), show_progress=False, matmul_precision="int8")
    assert any(how in llm.kernels["matmul"] for how in ("vpdpbusd", "vpmaddubsw", "scalar")), llm.kernels
    with pytest.raises(ConfigError, match="matmul_precision='int8' multiplies quantized matrices"):
        LLM(str(checkpoint_factory()), show_progress=False, matmul_precision="int8")


def test_the_header_reader_reads_what_gguf_reads():
    """weft's GGUF reader against the gguf package's, on llama.cpp's Q4_K_M file (F32, Q4_K and Q6_K
    tensors): every key's value and types, every tensor's name, shape, type and data."""
    from gguf import GGUFReader

    path = GGUF_DIR / FILES["q4_k_m"]
    ours, theirs = GgufFile(path), GGUFReader(str(path))
    expected = {k: f for k, f in theirs.fields.items() if not k.startswith("GGUF.")}  # the reader's own
    assert list(ours.fields) == list(expected)
    for key, field in expected.items():
        assert ours.fields[key].contents() == field.contents(), key
        assert ours.fields[key].types == field.types, key
    assert {t.tensor_type.name for t in ours.tensors} == {"F32", "Q4_K", "Q6_K"}
    for a, b in zip(ours.tensors, theirs.tensors, strict=True):
        assert (a.name, list(a.shape), a.tensor_type) == (b.name, list(b.shape), b.tensor_type)
        assert a.data.dtype == b.data.dtype and np.array_equal(a.data, b.data), a.name


def test_weft_quantize_writes_gguf_files_llama_cpp_reads(tmp_path, capsys):
    """`weft quantize`: Q8_0 of llama.cpp's own Q8_0 file gives back its tensors byte for byte and
    every key (read back by gguf's reader); of its Q4_K_M file, every matrix in Q8_0 blocks (the same
    tensors, names and shapes, within half a Q8_0 step of the Q4_K values), which weft then runs.
    Past the first file the outputs are read with weft's reader, which reads what gguf's does
    (test_the_header_reader_reads_what_gguf_reads) in a tenth of the time."""
    from gguf import GGUFReader
    from gguf.quants import dequantize

    from weft.cli import main

    source, again = GGUF_DIR / FILES["q8_0"], tmp_path / "again-q8_0.gguf"
    assert main(["quantize", str(source), str(again), "--type", "q8_0"]) == 0
    assert "15 matrices in Q8_0" in capsys.readouterr().out
    old, new = GgufFile(source), GGUFReader(str(again))  # weft's reader of the input, gguf's of the output
    assert [t.name for t in old.tensors] == [t.name for t in new.tensors]
    for a, b in zip(old.tensors, new.tensors, strict=True):
        assert a.tensor_type == b.tensor_type, a.name
        assert np.array_equal(np.asarray(a.data), np.asarray(b.data)), a.name
    keys = {k: f.contents() for k, f in old.fields.items()}
    assert keys == {k: f.contents() for k, f in new.fields.items() if not k.startswith("GGUF.")}

    source, q8 = GGUF_DIR / FILES["q4_k_m"], tmp_path / "from-q4_k_m.gguf"
    assert main(["quantize", str(source), str(q8)]) == 0
    old, new = GgufFile(source), GgufFile(q8)
    assert new.fields["general.file_type"].contents() == 7  # llama.cpp's MOSTLY_Q8_0
    for a, b in zip(old.tensors, new.tensors, strict=True):
        assert (a.name, list(a.shape)) == (b.name, list(b.shape))
        if len(a.shape) == 1:
            assert b.tensor_type == a.tensor_type
            continue
        assert b.tensor_type.name == "Q8_0"
        before, after = dequantize(a.data, a.tensor_type), dequantize(b.data, b.tensor_type)
        step = np.abs(before).reshape(-1, 32).max(axis=1, keepdims=True) / 127  # [blocks, 1]
        bound = (0.5 + 127 * 2.0**-11) * step + 1e-6  # half a step, and the step's float16 rounding
        assert (np.abs(after - before).reshape(-1, 32) <= bound).all(), a.name
    llm = LLM(str(q8), show_progress=False)
    assert llm.kernels["linear"].endswith("Q8_0 for 9 matrices (int8 dot panels)")
    q4 = tmp_path / "q4_k.gguf"  # Q4_K blocks, the token embedding in Q8_0
    assert main(["quantize", str(GGUF_DIR / FILES["q8_0"]), str(q4), "--type", "q4_k"]) == 0
    types = {t.name: t.tensor_type.name for t in GgufFile(q4).tensors if len(t.shape) == 2}
    assert types.pop("token_embd.weight") == "Q8_0" and set(types.values()) == {"Q4_K"}
    assert "Q4_K for 8 matrices" in LLM(str(q4), show_progress=False).kernels["linear"]
    capsys.readouterr()
    assert main(["quantize", str(q8), str(q8)]) == 2
    assert "the output would overwrite the input" in capsys.readouterr().err


def _sentencepiece_metadata(model_file: Path) -> tuple[dict, Any]:
    """A GGUF file's tokenizer keys for a SentencePiece model, as llama.cpp's converter writes them
    (pieces, scores, types: 2 unknown, 3 control, 6 byte, 1 normal)."""
    import sentencepiece

    sp = sentencepiece.SentencePieceProcessor(model_file=str(model_file))
    n = sp.GetPieceSize()
    kinds = [(sp.is_unknown, 2), (sp.is_control, 3), (sp.is_byte, 6)]
    types = [next((t for test, t in kinds if test(i)), 1) for i in range(n)]
    metadata = {
        "tokenizer.ggml.model": "llama",
        "tokenizer.ggml.tokens": [sp.id_to_piece(i) for i in range(n)],
        "tokenizer.ggml.scores": [sp.get_score(i) for i in range(n)],
        "tokenizer.ggml.token_type": types,
        "tokenizer.ggml.bos_token_id": sp.bos_id(),
        "tokenizer.ggml.eos_token_id": sp.eos_id(),
        "tokenizer.ggml.add_bos_token": True,
    }
    return metadata, sp


SENTENCEPIECE_MODELS = ["llama2/tokenizer.model", "mistral/tokenizer.model.v1", "mistral/tokenizer.model.v3"]


@pytest.mark.parametrize("model", SENTENCEPIECE_MODELS)
def test_sentencepiece_gguf_tokenizers_encode_as_sentencepiece_does(model):
    """A SentencePiece GGUF tokenizer (Llama 2, Mistral): the ids of SentencePiece itself on
    llama.cpp's tokenizer test inputs and a corpus, llama.cpp's own recorded ids for Llama 2, the
    same decoded text, and BOS added as the file says."""
    from weft.gguf_tokenizer import tokenizer_from_gguf

    metadata, sp = _sentencepiece_metadata(SHARED / "tokenizers" / model)
    tokenizer, config = tokenizer_from_gguf(metadata, model)
    tests = SHARED / "tokenizer_tests"
    texts = (tests / "ggml-vocab-llama-spm.gguf.inp").read_text().split("\n__ggml_vocab_test__\n")
    expected = (tests / "ggml-vocab-llama-spm.gguf.out").read_text().split("\n")
    corpus = sorted((SHARED / "corpora").rglob("*.txt"))
    lines = corpus[0].read_text(encoding="utf-8", errors="replace")[:20000].splitlines()[:200]
    for text in texts + lines:
        ids = tokenizer.encode(text, add_special_tokens=False).ids
        assert ids == sp.encode(text) and tokenizer.decode(ids) == sp.decode(ids), text
    if model.startswith("llama2"):
        for text, line in zip(texts, expected, strict=False):
            ids = tokenizer.encode(text, add_special_tokens=False).ids
            assert ids == [int(i) for i in line.split()], text
    assert tokenizer.encode("Hi").ids[0] == sp.bos_id() and config["bos_token"] == "<s>"


def test_the_converters_rotary_order_is_undone():
    """llama.cpp's converter stores q/k rows of each head as (half, pair) interleaved; the reader
    puts them back."""
    heads, head_dim, features = 3, 8, 5
    weight = torch.randn(heads * head_dim, features)
    converted = weight.reshape(heads, 2, head_dim // 2, features).swapaxes(1, 2).reshape(weight.shape)
    assert torch.equal(unpermute_rotary_rows(converted, heads), weight)
    assert hf_name("blk.3.attn_q.weight") == "model.layers.3.self_attn.q_proj.weight"
    assert hf_name("blk.0.ffn_norm.weight") == "model.layers.0.post_attention_layernorm.weight"
    assert hf_name("token_embd.weight") == "model.embed_tokens.weight" and hf_name("blk.0.odd.weight") is None


def _write_gguf(path: Path, arch: str = "llama", tensor_type: str = "F32") -> Path:
    """A small GGUF file written with the gguf package: one tensor of `tensor_type`."""
    import gguf

    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(1)
    writer.add_tensor("output_norm.weight", np.ones(32, dtype=np.float32))
    if tensor_type != "F32":
        qtype = getattr(gguf.GGMLQuantizationType, tensor_type)
        block, size = gguf.GGML_QUANT_SIZES[qtype]
        raw = np.zeros((4, 256 // block * size), dtype=np.uint8)
        writer.add_tensor("blk.0.attn_q.weight", raw, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_bad_gguf_files_are_clear_errors(tmp_path):
    with pytest.raises(GgufError, match="architecture 'gemma' is not supported; weft runs GGUF files of"):
        GgufCheckpoint(_write_gguf(tmp_path / "gemma.gguf", arch="gemma"))
    with pytest.raises(GgufError, match="stored as IQ2_XXS, which weft does not run; weft runs F32"):
        GgufCheckpoint(_write_gguf(tmp_path / "iq2.gguf", tensor_type="IQ2_XXS"))
    truncated = tmp_path / "truncated.gguf"
    source = (GGUF_DIR / FILES["q8_0"]).read_bytes()
    truncated.write_bytes(source[: len(source) // 2])
    with pytest.raises(GgufError, match=r"truncated\.gguf: not a readable GGUF file"):
        GgufCheckpoint(truncated)
    header_only = tmp_path / "header.gguf"
    header_only.write_bytes(b"GGUF" + struct.pack("<I", 3) + b"\x01")
    with pytest.raises(GgufError, match=r"header\.gguf: not a readable GGUF file"):
        LLM(str(header_only), show_progress=False)
    not_gguf = tmp_path / "model.gguf"
    not_gguf.write_bytes(b"PK\x03\x04 not a gguf file")
    with pytest.raises(ConfigError, match="neither a checkpoint directory nor a GGUF file"):
        LLM(str(not_gguf), show_progress=False)


def test_a_tokenizer_directory_overrides_the_files_own(tmp_path):
    family = SHARED / "tokenizers" / "smollm2"
    copy = tmp_path / "tok"
    shutil.copytree(family, copy)
    llm = LLM(str(GGUF_DIR / FILES["q8_0"]), tokenizer=str(copy), show_progress=False)
    assert llm.tokenizer.encode("Hello world") == Tokenizer.from_dir(family).encode("Hello world")


def test_rope_freqs_factors_give_llama3_scaling():
    """A Llama 3.1+ GGUF file carries its rope scaling as per-frequency factors (rope_freqs, made by
    llama.cpp's converter from the llama3 parameters as below): dividing each frequency by its factor
    gives the llama3-scaled frequencies of the Hugging Face config."""
    import math

    from weft.config import RopeConfig, RopeType
    from weft.model.layers import rope_inv_freq

    llama3 = RopeConfig(500000.0, RopeType.LLAMA3, 32.0, 1.0, 4.0, 8192)
    dim = 64
    freqs = 1.0 / (llama3.theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    low_wavelen = llama3.original_max_position_embeddings / llama3.low_freq_factor
    high_wavelen = llama3.original_max_position_embeddings / llama3.high_freq_factor
    factors = []
    for freq in freqs.tolist():  # the converter's computation
        wavelen = 2 * math.pi / freq
        if wavelen < high_wavelen:
            factors.append(1.0)
        elif wavelen > low_wavelen:
            factors.append(llama3.factor)
        else:
            smooth = (llama3.original_max_position_embeddings / wavelen - llama3.low_freq_factor) / (
                llama3.high_freq_factor - llama3.low_freq_factor
            )
            factors.append(1 / ((1 - smooth) / llama3.factor + smooth))
    stored = tuple(float(f) for f in np.array(factors, dtype=np.float32))  # float32 in the file
    from_file = rope_inv_freq(dim, RopeConfig(500000.0, freq_factors=stored))
    torch.testing.assert_close(from_file, rope_inv_freq(dim, llama3), rtol=1e-6, atol=0)


def test_bench_throughput_measures_a_gguf_file_as_it_is_stored(tmp_path, capsys, monkeypatch):
    """`weft bench throughput --model FILE.gguf`: weft on the file's quantized blocks (a decode step
    reads about the file's bytes), every rate measured; without llama-cpp-python the llama.cpp
    reference is a clear error that says what to install."""
    from weft.cli import main

    path, out = GGUF_DIR / FILES["q8_0"], tmp_path / "result.json"
    args = ["bench", "throughput", "--model", str(path), "--batch-sizes", "1,2", "--prompt-len", "8"]
    args += ["--output-len", "6", "--repeats", "1"]
    assert main([*args, "--no-reference", "--json", str(out)]) == 0
    run = json.loads(out.read_text())["runs"]["float32"]
    assert run["reference"] is None and "Q8_0 for 9 matrices (int8 dot panels)" in run["kernels"]["linear"]
    file_bytes = sum(t.data.nbytes for t in GgufFile(path).tensors)
    assert abs(run["weight_bytes"] - file_bytes) < 0.02 * file_bytes
    for r in run["results"]:
        assert 1 < r["weft_decode_tps"] < 1e6 and 1 < r["weft_prefill_tps"] < 1e7
        assert "ref_decode_tps" not in r
    capsys.readouterr()
    monkeypatch.setitem(sys.modules, "llama_cpp", None)  # as where llama-cpp-python is not installed
    assert main(args) == 2
    assert "pip install llama-cpp-python" in capsys.readouterr().err


@pytest.mark.parametrize("name", ["q4_k_m", "q4_0"] if torch.cuda.is_available() else ["q4_k_m"])
def test_triton_kernels_multiply_the_blocks_as_the_file_stores_them(name, monkeypatch):
    """The Triton kernel set (CUDA; here Triton's interpreter where there is no GPU) keeps every
    quantized matrix in its GGUF blocks, the tied table included (no float copy), and its logits
    equal transformers' float32 dequantization of the same file within 1e-4 (float32 activations:
    exact float32 products, prompt rows through `tl.dot`, decode rows through products and sums)."""
    pytest.importorskip("transformers")
    monkeypatch.setenv("WEFT_KERNELS", "triton")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    path = GGUF_DIR / FILES[name]
    if not path.is_file():  # a GPU machine carries only some of the files
        pytest.skip(f"{path} is not here")
    llm = LLM(str(path), show_progress=False, max_logprobs=20, device=device, dtype="float32")
    model = llm.engine.model
    assert "(GGUF blocks, dequantized in the kernel)" in llm.kernels["linear"], llm.kernels
    assert model.embed.weight.dtype == torch.uint8 and model.lm_head.weight is model.embed.weight
    assert model.layers[0].mlp.down.weight.dtype == torch.uint8
    hf = transformers_load(path)
    ids = [17, 4000, 123, 9000, 48000, 77, 2024, 31337, 5, 6]
    params = SamplingParams(max_tokens=2, temperature=0, prompt_logprobs=20, logprobs=20, ignore_eos=True)
    out = llm.generate([ids], params, use_tqdm=False)[0]
    tokens = out.outputs[0].token_ids
    with torch.no_grad():
        logits = hf(torch.tensor([ids + tokens])).logits[0].float()
    expected = torch.log_softmax(logits, dim=-1)  # [T, V]
    for pos, entry in enumerate(out.prompt_logprobs[1:], start=1):
        for token, logprob in entry.items():
            assert abs(logprob.logprob - expected[pos - 1, token].item()) <= 1e-4
    for step, entry in enumerate(out.outputs[0].logprobs):  # decode rows
        assert tokens[step] == int(expected[len(ids) - 1 + step].argmax())
        for token, logprob in entry.items():
            assert abs(logprob.logprob - expected[len(ids) - 1 + step, token].item()) <= 1e-4


@pytest.mark.parametrize("arch", ["gemma2", "gemma3", "qwen3moe", "smollm3", "granite", "phi3"])
def test_random_gguf_files_of_other_families_run(checkpoint_factory, tmp_path, arch):
    """`weft bench throughput --gguf-type` files of Gemma, Qwen3-MoE, SmolLM3, Granite and Phi-3 shapes
    (the first layer of two): weft reads their configuration back (Granite's scales, Phi-3's partial
    rotary embedding and LongRoPE factors too) and runs them from their blocks."""
    from weft.bench.random_gguf import word_level_tokenizer, write_random_gguf

    config = checkpoint_factory(arch) / "config.json"
    path = write_random_gguf(config, "q8_0", tmp_path / "random.gguf", num_layers=1)
    tokenizer = word_level_tokenizer(384, tmp_path / "tokenizer")
    llm = LLM(str(path), tokenizer=str(tokenizer), show_progress=False)
    source = json.loads(config.read_text())
    assert llm.config.model.num_layers == 1 and llm.config.model.architecture == source["architectures"][0]
    assert llm.config.model.num_experts == (source.get("num_local_experts") or 0)
    if arch == "granite":
        assert (llm.config.model.embedding_multiplier, llm.config.model.logits_scaling) == (3.0, 2.0)
    if arch == "phi3":
        rope, scaling = llm.config.model.rope, source.get("rope_scaling") or source["rope_parameters"]
        assert rope.rope_type.value == "longrope" and rope.partial_rotary_factor == 0.75
        for factors in ("long_factor", "short_factor"):  # float32 tensors in the file, as llama.cpp's
            assert list(getattr(rope, factors)) == np.float32(scaling[factors]).tolist()
    assert "Q8_0" in llm.kernels["linear"]
    (out,) = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
    assert len(out.outputs[0].token_ids) == 4


def test_random_q4_k_m_files_take_llama_cpps_mix():
    """Q4_K_M as llama.cpp's quantizer makes it: Q6_K for the output matrix and, in the layers its
    use_more_bits picks (the first and last eighth, and every third between), for attn_v and ffn_down,
    a MoE layer's ffn_down_exps included; Q5_K for a fused q|k|v; Q5_0 where a matrix's rows are not
    whole super-blocks."""
    from weft.bench.random_gguf import tensor_kind

    picked = [
        layer for layer in range(48) if tensor_kind("q4_k_m", "ffn_down_exps", layer, 48, 768) == "q6_k"
    ]
    assert picked == [0, 1, 2, 3, 4, 5, 8, 11, 14, 17, 20, 23, 26, 29, 32, 35, 38, 41, 42, 43, 44, 45, 46, 47]
    assert [tensor_kind("q4_k_m", "attn_v", layer, 48, 2048) for layer in picked] == ["q6_k"] * len(picked)
    assert tensor_kind("q4_k_m", "ffn_gate_exps", 0, 48, 2048) == "q4_k"
    assert tensor_kind("q4_k_m", "output", 0, 48, 2048) == "q6_k"
    assert tensor_kind("q4_k_m", "ffn_down", 6, 48, 1152) == "q5_0"  # 1,152 features
    assert tensor_kind("q4_k_m", "attn_qkv", 6, 32, 3072) == "q5_k"  # Phi-3's fused q|k|v


def test_random_gpt_oss_files_hold_mxfp4_experts(checkpoint_factory, tmp_path):
    """`--gguf-type mxfp4` writes gpt-oss's experts in MXFP4 blocks and its other matrices in Q8_0,
    as the published files hold them, with its YaRN scaling; weft runs them (the experts from MXFP4
    dot panels of their own)."""
    from weft.bench.random_gguf import word_level_tokenizer, write_random_gguf

    config = checkpoint_factory("gptoss") / "config.json"
    path = write_random_gguf(config, "mxfp4", tmp_path / "random.gguf", num_layers=2)
    kinds = {t.name: t.tensor_type.name for t in GgufFile(path).tensors}
    assert kinds["blk.1.ffn_up_exps.weight"] == kinds["blk.0.ffn_down_exps.weight"] == "MXFP4"
    assert kinds["blk.0.attn_q.weight"] == kinds["output.weight"] == "Q8_0"
    tokenizer = word_level_tokenizer(384, tmp_path / "tokenizer")
    llm = LLM(str(path), tokenizer=str(tokenizer), show_progress=False)
    model = llm.config.model
    assert (model.num_layers, model.num_experts, model.rope.theta) == (2, 4, 150000.0)
    assert (model.rope.rope_type.value, model.rope.factor) == ("yarn", 8.0)
    assert "MXFP4 for 16 matrices" in llm.kernels["linear"], llm.kernels["linear"]  # 2 layers x 4 x 2
    (out,) = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
    assert len(out.outputs[0].token_ids) == 4


def test_triton_half_precision_decode_rows_meet_k_quants_as_int8(monkeypatch, reference):
    """In bfloat16 the Triton kernel set's decode rows multiply Q4_K and Q6_K blocks with int8
    activations (`block_gemv_q8`, rounded as llama.cpp rounds them): every quantized product of a
    decode step goes there, and the chosen tokens' logprobs stay about as close to transformers'
    float32 dequantization as weft's CPU kernels, which round the same way, get on this file: mean
    |dlogp| over these 16 rows 0.108 on CPU, 0.135 here (0.066 with float products, `block_gemv`)."""
    from weft.cuda import block_gemv_q8

    monkeypatch.setenv("WEFT_KERNELS", "triton")
    kinds: list[tuple[str, int]] = []
    original = block_gemv_q8.gemv_q8

    def counted(x: torch.Tensor, w: torch.Tensor, kind: str, *args: Any) -> None:
        kinds.append((kind, x.shape[0]))
        original(x, w, kind, *args)

    monkeypatch.setattr(block_gemv_q8, "gemv_q8", counted)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    path = GGUF_DIR / FILES["q4_k_m"]
    llm = LLM(str(path), show_progress=False, device=device, dtype="bfloat16", enforce_eager=True)
    prompts = [list(p)[:8] for p in reference["prompts"][:4]]  # 4 decode rows a step: the GEMV's
    params = SamplingParams(max_tokens=5, temperature=0, logprobs=1, ignore_eos=True)
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert {kind for kind, _ in kinds} == {"q4_k", "q6_k"} and max(rows for _, rows in kinds) <= 4
    gaps = []
    for prompt, out in zip(prompts, outs, strict=True):
        tokens = out.outputs[0].token_ids
        with torch.no_grad():
            logits = transformers_load(path)(torch.tensor([prompt + tokens])).logits[0].float()
        expected = torch.log_softmax(logits, dim=-1)  # [T, V]
        for step in range(1, len(tokens)):  # the decode rows (the first token is the prompt's)
            got = out.outputs[0].logprobs[step][tokens[step]].logprob
            gaps.append(abs(got - expected[len(prompt) - 1 + step, tokens[step]].item()))
    assert len(gaps) == 16 and float(np.mean(gaps)) <= 0.2, gaps
