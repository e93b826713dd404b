"""Checkpoint loading: every bad input names the file and the problem."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from weft import LLM
from weft.config import ConfigError
from weft.model.loader import CheckpointError


@pytest.fixture
def ckpt(tiny_llama, tmp_path) -> Path:
    dst = tmp_path / "ckpt"
    shutil.copytree(tiny_llama, dst)
    return dst


def edit_config(path: Path, **changes) -> None:
    config = json.loads((path / "config.json").read_text())
    config.update(changes)
    (path / "config.json").write_text(json.dumps(config))


def test_missing_config(ckpt):
    (ckpt / "config.json").unlink()
    with pytest.raises(ConfigError, match=r"config.json: file not found"):
        LLM(str(ckpt), show_progress=False)


def test_unknown_architecture(ckpt):
    edit_config(ckpt, architectures=["GPT2LMHeadModel"])
    with pytest.raises(
        ConfigError, match=r"'GPT2LMHeadModel' is not supported; supported: .*LlamaForCausalLM"
    ):
        LLM(str(ckpt), show_progress=False)


def test_partial_rotary_with_qk_biases_or_norms_is_refused(ckpt):
    """Such a model would need its biases and norms reordered as q's and k's rows are: refused, by
    name, before any weight is read."""
    edit_config(ckpt, partial_rotary_factor=0.5, attention_bias=True)
    with pytest.raises(ConfigError, match=r"partial rotary embedding .*0\.5.* q/k/v biases is not supported"):
        LLM(str(ckpt), show_progress=False)
    edit_config(ckpt, architectures=["Qwen3ForCausalLM"], attention_bias=False)
    with pytest.raises(ConfigError, match=r"q/k norms is not supported"):
        LLM(str(ckpt), show_progress=False)


def test_shape_mismatch_names_tensor_and_file(ckpt):
    edit_config(ckpt, intermediate_size=96)
    with pytest.raises(
        CheckpointError,
        match=r"model.safetensors: tensor 'model.layers.0.mlp.gate_proj.weight' "
        r"has shape \(128, 64\), but config.json implies \(96, 64\)",
    ):
        LLM(str(ckpt), show_progress=False)


def test_corrupt_safetensors(ckpt):
    (ckpt / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json")
    with pytest.raises(CheckpointError, match=r"model\.safetensors: not a readable safetensors file"):
        LLM(str(ckpt), show_progress=False)


def test_missing_tensor(ckpt):
    tensors = load_file(ckpt / "model.safetensors")
    del tensors["model.layers.1.self_attn.k_proj.weight"]
    save_file(tensors, ckpt / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=r"no tensor 'model\.layers\.1\.self_attn\.k_proj\.weight'"):
        LLM(str(ckpt), show_progress=False)


def test_missing_weights(ckpt):
    (ckpt / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match=r"no \*\.safetensors weights found"):
        LLM(str(ckpt), show_progress=False)


def test_missing_tokenizer(ckpt):
    (ckpt / "tokenizer.json").unlink()
    with pytest.raises(ConfigError, match=r"tokenizer\.json: file not found"):
        LLM(str(ckpt), show_progress=False)


def test_sharded_checkpoint_loads_like_single_file(ckpt, tiny_llama):
    tensors = load_file(ckpt / "model.safetensors")
    names = sorted(tensors)
    half = len(names) // 2
    shards = {
        "model-00001-of-00002.safetensors": names[:half],
        "model-00002-of-00002.safetensors": names[half:],
    }
    for file, keys in shards.items():
        save_file({k: tensors[k] for k in keys}, ckpt / file, metadata={"format": "pt"})
    (ckpt / "model.safetensors").unlink()
    index = {"metadata": {}, "weight_map": {k: f for f, keys in shards.items() for k in keys}}
    (ckpt / "model.safetensors.index.json").write_text(json.dumps(index))
    sharded = LLM(str(ckpt), show_progress=False).engine.model.state_dict()
    single = LLM(str(tiny_llama), show_progress=False).engine.model.state_dict()
    for name, value in single.items():
        assert torch.equal(sharded[name], value), name


def test_model_id_offline_fails_clearly(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ConfigError, match="offline"):
        LLM("someone/some-model-that-is-not-here", show_progress=False)


def test_not_a_directory(tmp_path):
    with pytest.raises(ConfigError, match="neither a checkpoint directory nor a GGUF file"):
        LLM(str(tmp_path / "nope"), show_progress=False)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_loads_and_generates(tiny_llama, dtype):
    from weft import SamplingParams

    llm = LLM(str(tiny_llama), dtype=dtype, show_progress=False)
    assert llm.engine.model.lm_head.weight.dtype == dtype
    out = llm.generate("First", SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 8


def test_bad_dtype():
    from weft.config import resolve_dtype

    with pytest.raises(ConfigError, match="dtype 'float8' is not supported"):
        resolve_dtype("float8", torch.device("cpu"))
