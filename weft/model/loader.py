"""Load a Hugging Face checkpoint directory (config.json + safetensors), or a GGUF file, into a weft
model.

Steps:
  1. read config.json (or the GGUF file's metadata, `weft/model/gguf_checkpoint.py`) and resolve
     the architecture;
  2. list the safetensors files (one file, or many named by model.safetensors.index.json);
  3. read every tensor, with a progress bar, checking names and shapes against the config (a GGUF
     file's tensors under their Hugging Face names; where the model uses panels its quantized
     matrices stay in their blocks, `weft/model/quantized.py`, the rest is dequantized to float32);
  4. fuse q/k/v and gate/up into single matrices ([out, in] as in the checkpoint);
  5. move to the target device and dtype (no copy when the checkpoint is stored in that dtype);
  6. on CPU, make sure weft's native kernels are built and loaded (`weft/native`);
  7. on CPU, store the matrices in the layout that streams fastest there: column panels for weft's
     GEMM kernel (float32, bfloat16 or float16 weights), or [in, out] without the kernels
     (`weight_layout`, see `Linear`); with half-precision panels the activations, the norms' weights
     and the biases are float32 (`TorchKernels.activation_dtype`), and bfloat16 panels multiply with
     bfloat16 products where `matmul_dtype` says so (`Linear.bf16_dot`); quantized matrices go into
     dot panels for int8 products where `matmul_dtype` is int8 (`weft/native/qdot.cpp`), else into
     exact quantized panels.

Every error names the file and the problem.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import cast

import torch
from torch import nn
from tqdm.auto import tqdm

from weft.config import ConfigError, ModelConfig, NativeConfig
from weft.kernels import TorchKernels
from weft.model import safetensors_io
from weft.model.gguf_checkpoint import GgufCheckpoint, is_gguf
from weft.model.huge_pages import HugePages, huge_pages_available, move_weights_to_huge_pages
from weft.model.layers import (
    BlockWeight,
    Embedding,
    Linear,
    RMSNorm,
    WeightLayout,
    partial_rotary_order,
    rotary_dims,
    weight_layout,
)
from weft.model.llama import DecoderSpec, LlamaForCausalLM
from weft.model.prefill_gemm import Shape, apply_dense_rows, choose_dense_rows
from weft.model.quantize import quantize_rows, quantizes
from weft.model.quantized import (
    REWRITTEN,
    FileRows,
    MixedRows,
    PartedRows,
    QuantizedRows,
    Weight,
    cat_rows,
    dequantized,
    flat_blocks,
    logical_shape,
    release_read,
)
from weft.model.registry import resolve_architecture
from weft.parallel.group import TensorParallel
from weft.parallel.shard import Shard

EMBED = "model.embed_tokens.weight"
# The kinds whose exact panels a tied table's lookups read (Q8_0's and Q6_K's, and the kinds packed as
# them); a tied Q4_K table for float32 products is packed from its float32 values.
LOOKED_UP = ("q8_0", "q6_k", "q4_0", "q5_0", "q3_k", "iq4_nl")


class CheckpointError(ValueError):
    """A checkpoint file that cannot be loaded; the message names the file and the problem."""


def safetensors_files(model_dir: Path) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError) as exc:
            raise CheckpointError(f"{index}: not a valid safetensors index ({exc})") from None
        files = [model_dir / name for name in sorted(set(weight_map.values()))]
    else:
        files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise CheckpointError(
            f"{model_dir}: no *.safetensors weights found (is this a checkpoint directory?)"
        )
    for path in files:
        if not path.is_file():
            raise CheckpointError(f"{path}: listed in model.safetensors.index.json but missing")
    return files


Source = Path | GgufCheckpoint  # a checkpoint directory, or an opened GGUF file


def open_source(path: Path) -> Source:
    """`path` as a checkpoint source: a GGUF file is opened (once: its header takes a while to read)."""
    return GgufCheckpoint(path) if is_gguf(path) else path


def checkpoint_tensors(
    source: Source, show_progress: bool = True, keep_blocks: bool = False
) -> Iterator[tuple[str, Path, Weight]]:
    """(Hugging Face name, file, weight) for every tensor of a checkpoint directory or GGUF file
    (with `keep_blocks`, quantized matrices in their blocks: `weft/model/quantized.py`)."""
    if not isinstance(source, GgufCheckpoint):
        yield from read_tensors(safetensors_files(source), show_progress)
        return
    for name, tensor in source.read_tensors(keep_blocks):  # views of the mapping: read when packed
        yield name, source.path, tensor


def read_tensors(files: list[Path], show_progress: bool = True) -> Iterator[tuple[str, Path, torch.Tensor]]:
    """Yield (name, file, tensor) for every tensor in `files`, each read into its own buffer (see
    `weft.model.safetensors_io`)."""
    headers = []
    for path in files:
        try:
            headers.append(safetensors_io.read_header(path)[0])
        except (safetensors_io.SafetensorsError, OSError) as exc:
            raise CheckpointError(f"{path}: not a readable safetensors file ({exc})") from None
    total = sum(len(header) for header in headers)
    with tqdm(
        total=total, desc="Loading weights", unit="tensor", disable=not show_progress, leave=False
    ) as bar:
        for path in files:
            try:
                for name, tensor in safetensors_io.read_tensors(path):
                    bar.update(1)
                    yield name, path, tensor
            except (safetensors_io.SafetensorsError, OSError) as exc:
                raise CheckpointError(f"{path}: not a readable safetensors file ({exc})") from None


class _Weights:
    """The checkpoint's tensors by Hugging Face name, remembering which file each came from."""

    def __init__(self, file_experts: bool = False) -> None:
        self.file_experts = file_experts  # experts stay in the file's blocks where their kinds allow
        self.tensors: dict[str, Weight] = {}
        self.files: dict[str, Path] = {}
        self.packed: set[str] = set()  # names kept as panels, their [out, in] shape checked when packed
        self.kinds: dict[str, str] = {}  # the quantized kind of packed panels ("q8_0", ...)

    def add(self, name: str, path: Path, tensor: Weight) -> None:
        self.tensors[name] = tensor
        self.files[name] = path

    def pack(self, name: str, shape: tuple[int, ...], dtype: torch.dtype, dot: bool = False) -> None:
        """Check the [out, in] matrix `name` against `shape`, and keep it as panels in `dtype` (or of
        its quantized kind, if it came in blocks: `dot` panels for int8 products)."""
        matrix = self.take(name, shape)
        if isinstance(matrix, QuantizedRows) and (dot or matrix.kind in LOOKED_UP):
            panels = matrix.pack(dot)
            self.kinds[name] = matrix.kind
        else:
            panels = torch.ops.weft.pack_linear_weight(dequantized(matrix).to(dtype))
        release_read(matrix)
        self.add(name, self.files[name], panels)
        self.packed.add(name)

    def take(self, name: str, shape: tuple[int, ...]) -> Weight:
        if name not in self.tensors:
            raise CheckpointError(f"checkpoint has no tensor {name!r}, which the config requires")
        tensor = self.tensors.pop(name)
        if name in self.packed:  # checked when packed
            return tensor
        if logical_shape(tensor) != shape:
            raise CheckpointError(
                f"{self.files[name]}: tensor {name!r} has shape {logical_shape(tensor)}, "
                f"but config.json implies {shape}"
            )
        return tensor


def load_model(
    model_dir: Source,
    config: ModelConfig,
    dtype: torch.dtype,
    device: torch.device,
    max_positions: int,
    show_progress: bool = True,
    matmul_dtype: torch.dtype | None = None,
    quantization: str | None = None,
    *,
    kernels: TorchKernels,
    tp: TensorParallel | None = None,
    file_experts: bool = False,
) -> LlamaForCausalLM:
    """Steps, with the device's kernel set (`weft.engine.factory.kernels_for`): read the tensors,
    build the model on the meta device, load the converted weights,
    move to the device and dtype, tie the embeddings, and put linear weights in the layout the
    kernel set streams fastest. `matmul_dtype` bfloat16 with bfloat16 panels: bfloat16 products
    (which never take the dense GEMM: it would multiply in float32, at half their rate).
    `quantization` ("q8_0", "q4_k"): float matrices become blocks of that type as they are read
    (`weft/model/quantize.py`); it needs the panels of weft's CPU kernels. `tp`: this process is
    one rank of a tensor-parallel model, which loads its part (weft/parallel/shard.py). `file_experts`:
    experts stay in the file's blocks where they can (int8 products: `FileRows`)."""
    arch = resolve_architecture(config)
    cut = None if tp is None else _Cut.of(tp, model_dir, quantization, config)
    config = config if cut is None else cut.shard.config(config)  # a rank: its heads, columns, vocabulary
    layout = weight_layout(kernels, device, dtype)
    packs_table = config.tie_word_embeddings and layout is WeightLayout.PANELS
    bf16_dot = layout is WeightLayout.PANELS and dtype == matmul_dtype == torch.bfloat16
    int8_dot = layout is WeightLayout.PANELS and matmul_dtype == torch.int8  # quantized matrices: qdot.cpp
    with torch.device("meta"):
        model = arch.model_class(config, arch.spec, max_positions, kernels)
    if tp is not None and cut is not None:
        model.shard(tp, cut.shard.vocab_start(cut.full))
    panels = layout is WeightLayout.PANELS
    dense_rows = _dense_rows(model, dtype, show_progress) if panels and not bf16_dot else {}
    blocks = not panels and kernels.multiplies_blocks(device)  # quantized matrices stay in their blocks
    _check_quantization(quantization, layout)
    read = (packs_table, show_progress, panels or blocks, int8_dot, quantization, cut)
    weights = _read_weights(model_dir, config, dtype, *read, file_experts=file_experts and int8_dot)
    packs_table = _tie_packed_table(model, weights)
    pages = HugePages() if panels and huge_pages_available() else None  # panels go there as packed
    converted = _packing_progress(_convert(weights, arch.spec, config), model, show_progress)
    state = _expected_state(model, converted, kernels, blocks, int8_dot, pages)
    model.load_state_dict(state, assign=True, strict=True)
    del state, weights  # the model holds the only references: packing frees each matrix as it goes
    model = model.to(device=device, dtype=dtype).eval()
    model.build_rotaries(max_positions, device)  # off the meta device
    _place_weights(model, config, layout, packs_table, pages)
    _set_activation_dtype(model, kernels.activation_dtype(device, dtype))
    if layout is WeightLayout.PANELS:
        apply_dense_rows(_body_linears(model), dense_rows)
        model.dense_rows = dense_rows
    model.set_bf16_dot(bf16_dot)
    model.fuse_stack()
    return model


def _tie_packed_table(model: LlamaForCausalLM, weights: _Weights) -> bool:
    """Whether the tied table arrived packed (a checkpoint without it fails in _convert, by name):
    then the lm_head's panels, looked up by the embedding."""
    if EMBED not in weights.packed:
        return False
    table = weights.tensors[EMBED]
    assert isinstance(table, torch.Tensor)  # packed: panels
    model.lm_head.expect_panels(table.shape, quantized=weights.kinds.get(EMBED))  # (on meta)
    model.embed.read_from_panels(model.lm_head)
    return True


def _packing_progress(
    converted: Iterator[tuple[str, Weight]], model: LlamaForCausalLM, show: bool
) -> Iterator[tuple[str, Weight]]:
    """The weights as they are converted and packed, counted on a progress bar where `show`: where
    a load's time goes (a GGUF file's tensors are views of its mapping, read as they are packed)."""
    if not show:
        return converted
    bar = tqdm(converted, total=len(model.state_dict()), desc="Packing weights", unit="tensor", leave=False)
    return iter(bar)


def _panel_modules(model: LlamaForCausalLM) -> list[nn.Module]:
    """The modules whose weights are panels: every Linear in PANELS, and the embedding where it
    reads the lm_head's (so that it keeps sharing them)."""
    modules: list[nn.Module] = [
        m for m in model.modules() if isinstance(m, Linear) and m.layout is WeightLayout.PANELS
    ]
    return modules + ([model.embed] if model.embed.from_panels else [])


def _place_weights(
    model: LlamaForCausalLM,
    config: ModelConfig,
    layout: WeightLayout,
    packs_table: bool,
    pages: HugePages | None,
) -> None:
    """Tie the embedding table (one tensor) and put every matrix in `layout`; panels, streamed
    every step, in 2 MB pages where the OS has them (weft/model/huge_pages.py)."""
    if packs_table:
        model.embed.read_from_panels(model.lm_head)  # one tensor
    elif config.tie_word_embeddings:
        model.lm_head.weight = cast(nn.Parameter, model.embed.weight)  # one tensor, after the dtype too
    if layout is not WeightLayout.OUT_IN:
        for module in model.modules():
            kept = (layout, WeightLayout.BLOCKS, WeightLayout.FILE)  # (as they were read)
            if isinstance(module, Linear) and module.layout not in kept:
                module.set_layout(layout)
    if layout is WeightLayout.PANELS:
        model.huge_page_bytes = move_weights_to_huge_pages(_panel_modules(model), pages)


@dataclass(frozen=True, slots=True)
class _Cut:
    """A tensor-parallel rank's part of each tensor, as it is read."""

    shard: Shard
    full: ModelConfig  # the whole model's configuration

    @classmethod
    def of(cls, tp: TensorParallel, source: Source, quantization: str | None, config: ModelConfig) -> _Cut:
        cut = cls(Shard(tp.rank, tp.world_size), config)
        _check_shardable(source, quantization, cut.shard, config)
        return cut

    def __call__(self, name: str, tensor: Weight) -> Weight:
        assert isinstance(tensor, torch.Tensor)  # quantized checkpoints are refused with tensor parallel
        return self.shard.tensor(name, tensor, self.full)


def _check_shardable(source: Source, quantization: str | None, shard: Shard, config: ModelConfig) -> None:
    shard.check(config)
    if quantization is not None or (isinstance(source, GgufCheckpoint) and source.quantized):
        raise CheckpointError(
            f"tensor_parallel_size={shard.world_size} runs float checkpoints (safetensors, or GGUF files of "
            "F32/F16/BF16 tensors); a quantized model runs on one rank: leave tensor_parallel_size at 1"
        )


def _check_quantization(quantization: str | None, layout: WeightLayout) -> None:
    if quantization is not None and layout is not WeightLayout.PANELS:
        raise CheckpointError(
            f"quantization={quantization!r} runs on CPU with weft's kernels (this load uses {layout.value} "
            "weights); load the checkpoint without it, or on CPU"
        )


def _expect_quantized(
    model: LlamaForCausalLM, state: Iterator[tuple[str, Weight]], dot: bool, pages: HugePages | None
) -> dict[str, torch.Tensor]:
    """Pack every matrix that came in blocks into panels (`dot`: dot panels, for int8 products), its
    Linear (still on the meta device) taking their shape (a fusion of parts no one layout holds: in
    parts, `PartedRows`). With int8 products an untied embedding table in blocks goes into dot
    panels of its own and is looked up there (a float32 copy of a 151,936-token table is 1.2 GB);
    with exact products it is dequantized, as a fusion of mixed kinds or a matrix with no exact
    panels is. Each matrix is packed as it comes, into
    `pages` where given (huge pages), and the pages of the file it was read from leave resident
    memory (`release_read`)."""
    tensors: dict[str, torch.Tensor] = {}
    place = pages.copy if pages is not None else (lambda packed: packed)
    for name, source in state:
        module = model.get_submodule(name.rsplit(".", 1)[0])
        weight = source.in_own_layouts() if dot and isinstance(source, MixedRows) else source
        linear = module if isinstance(module, Linear) else None
        if isinstance(weight, FileRows) and linear is not None:  # (only with int8 products)
            file = weight.file_weight()
            tensors[name] = file.parts[0]
            linear.expect_file(file, weight.label)
        elif isinstance(weight, QuantizedRows) and (dot or weight.exact_panels) and linear is not None:
            tensors[name] = place(weight.pack(dot))
            linear.expect_panels(tensors[name].shape, quantized=weight.label)
        elif dot and isinstance(weight, PartedRows) and linear is not None:
            packed, parts = weight.pack()
            tensors[name] = place(packed)
            linear.expect_parts(parts, tensors[name].numel(), weight.label)
        elif dot and isinstance(weight, QuantizedRows) and isinstance(module, Embedding):
            tensors[name] = place(weight.pack(dot=True))
            module.expect_panels(tensors[name].shape)
        else:
            tensors[name] = dequantized(weight)
        release_read(source)
    return tensors


def _expected_state(
    model: LlamaForCausalLM,
    state: Iterator[tuple[str, Weight]],
    kernels: TorchKernels,
    blocks: bool,
    dot: bool,
    pages: HugePages | None,
) -> dict[str, torch.Tensor]:
    """The state to assign: matrices that came in blocks kept in them (`blocks`: the kernel set
    multiplies them) or packed into panels, the rest float."""
    return _expect_blocks(model, state, kernels) if blocks else _expect_quantized(model, state, dot, pages)


def _expect_blocks(
    model: LlamaForCausalLM, state: Iterator[tuple[str, Weight]], kernels: TorchKernels
) -> dict[str, torch.Tensor]:
    """Keep every matrix that came in blocks in them, flat (`WeightLayout.BLOCKS`), its Linear or
    Embedding (still on the meta device) taking their size: the kernel set multiplies them as they
    are; a kind it does not multiply (`block_kinds`) goes in the kind it is rewritten as where that
    one is multiplied (MXFP4 as Q5_0, Q3_K as Q6_K, IQ4_NL as Q8_0: exactly; a fusion's parts each),
    else is dequantized. A tied table is one tensor for both (re-tied after the move to the device)."""
    tensors: dict[str, torch.Tensor] = {}
    for name, weight in state:
        module = model.get_submodule(name.rsplit(".", 1)[0])
        weight = _as_multiplied(weight, kernels.block_kinds)
        if (
            isinstance(weight, (QuantizedRows, MixedRows))
            and isinstance(module, (Linear, Embedding))
            and set(weight.kinds) <= kernels.block_kinds
        ):
            flat, parts = flat_blocks(weight)
            tensors[name] = flat
            if isinstance(module, Linear):
                module.expect_blocks(BlockWeight(parts, kernels), flat.numel(), weight.label)
            else:
                module.expect_blocks(BlockWeight(parts, kernels), flat.numel())
        else:
            tensors[name] = dequantized(weight)
    return tensors


def _as_multiplied(weight: Weight, multiplied: frozenset[str]) -> Weight:
    """`weight` with its rows of a kind the kernels lack rewritten as the kind they are packed as,
    where the kernels multiply that one: a matrix, or each part of a fusion (Q2_K+Q3_K as
    Q2_K+Q6_K)."""
    if isinstance(weight, QuantizedRows) and _rewrites_for(weight.kind, multiplied):
        return weight.rewritten()
    if isinstance(weight, MixedRows) and any(_rewrites_for(k, multiplied) for k in weight.kinds):
        parts = (p.rewritten() if _rewrites_for(p.kind, multiplied) else p for p in weight.parts)
        return MixedRows(tuple(parts))
    return weight


def _rewrites_for(kind: str, multiplied: frozenset[str]) -> bool:
    """Whether a matrix of `kind` goes to kernels that multiply the `multiplied` kinds rewritten."""
    return kind not in multiplied and REWRITTEN.get(kind) in multiplied


def _dense_rows(model: LlamaForCausalLM, dtype: torch.dtype, show_progress: bool) -> dict[Shape, int]:
    """The prefill-GEMM threshold of each linear shape of `model` (still on the meta device:
    measured before any weight is read; weft/model/prefill_gemm.py)."""
    shapes = [(lin.in_features, lin.out_features, dtype) for lin in _body_linears(model)]
    native = NativeConfig.from_env()
    return choose_dense_rows(shapes, native.cache_dir, native.dense_rows, progress=show_progress)


def _body_linears(model: LlamaForCausalLM) -> list[Linear]:
    """Every Linear but the lm_head (a prefill computes logits for a few rows only)."""
    return [m for m in model.modules() if isinstance(m, Linear) and m is not model.lm_head]


def _read_weights(
    model_dir: Source,
    config: ModelConfig,
    dtype: torch.dtype,
    packs_table: bool,
    show_progress: bool,
    keeps_blocks: bool = False,
    dot: bool = False,
    quantization: str | None = None,
    cut: _Cut | None = None,
    file_experts: bool = False,
) -> _Weights:
    """Every tensor of the checkpoint; with `packs_table`, the tied embedding table is packed into
    panels as soon as it is read (`dot`: dot panels, if it came in blocks), so that it never sits in
    memory twice beside the other weights; with `keeps_blocks`, quantized GGUF matrices stay in
    their blocks (packed in `_expect_quantized`); with `quantization`, float matrices become blocks;
    with `cut`, each tensor is cut to a tensor-parallel rank's part as it is read; with
    `file_experts`, experts stay views of the file (`_expert_mlp`)."""
    weights = _Weights(file_experts)
    for name, path, tensor in checkpoint_tensors(model_dir, show_progress, keeps_blocks):
        if cut is not None:
            tensor = cut(name, tensor)
        if quantization is not None and quantizes(name, tensor, config.tie_word_embeddings):
            assert isinstance(tensor, torch.Tensor)
            tensor = quantize_rows(tensor, "q8_0" if name == EMBED else quantization)
        weights.add(name, path, tensor)
        if packs_table and name == EMBED:
            weights.pack(name, (config.vocab_size, config.hidden_size), dtype, dot)
    return weights


def _set_activation_dtype(model: LlamaForCausalLM, dtype: torch.dtype) -> None:
    """Put the small weights that meet the activations (norms, unpacked biases) in their dtype."""
    model.activation_dtype = dtype
    for module in model.modules():
        if isinstance(module, RMSNorm):
            module.weight = nn.Parameter(module.weight.to(dtype), requires_grad=False)


def _convert(weights: _Weights, spec: DecoderSpec, config: ModelConfig) -> Iterator[tuple[str, Weight]]:
    """Hugging Face names and layout -> weft's, checking every shape: one weft weight at a time, so
    that what a fusion copies is packed and freed before the next is made."""
    for name, weight in _renamed(weights, spec, config):
        if spec.norms_plus_one and name.endswith("norm.weight"):  # Gemma's norms scale by (1 + w)
            weight = cast(torch.Tensor, weight).float() + 1.0  # (in float32, as Gemma does)
        yield name, weight


def _renamed(weights: _Weights, spec: DecoderSpec, config: ModelConfig) -> Iterator[tuple[str, Weight]]:
    h, d = config.hidden_size, config.head_dim
    q_out, kv_out, inter = config.num_heads * d, config.num_kv_heads * d, config.intermediate_size
    embed = weights.take(EMBED, (config.vocab_size, h))
    yield "embed.weight", embed
    for i in range(config.num_layers):
        src, dst = f"model.layers.{i}.", f"layers.{i}."
        yield dst + "attn.qkv.weight", _fused(_qkv_rows(weights, src, config))
        if spec.qkv_bias:
            biases = [
                weights.take(src + f"self_attn.{p}_proj.bias", (n,))
                for p, n in (("q", q_out), ("k", kv_out), ("v", kv_out))
            ]
            yield dst + "attn.qkv.bias", cat_rows(biases)
        yield dst + "attn.o.weight", weights.take(src + "self_attn.o_proj.weight", (h, q_out))
        if spec.o_bias:
            yield dst + "attn.o.bias", weights.take(src + "self_attn.o_proj.bias", (h,))
        if spec.qk_norm:
            q_width, k_width = (q_out, kv_out) if spec.qk_norm_all_heads else (d, d)
            yield dst + "attn.q_norm.weight", weights.take(src + "self_attn.q_norm.weight", (q_width,))
            yield dst + "attn.k_norm.weight", weights.take(src + "self_attn.k_norm.weight", (k_width,))
        if config.attention_sinks:
            yield dst + "attn.sinks", weights.take(src + "self_attn.sinks", (config.num_heads,))
        if config.layer_has_experts(i):
            yield from _expert_weights(weights, src, dst + "mlp.", config)
        else:
            yield from _mlp_weights(weights, src + "mlp.", dst + "mlp.", h, inter).items()
        yield from _layer_norms(weights, spec, src, dst, h).items()
    yield "norm.weight", weights.take("model.norm.weight", (h,))
    if config.tie_word_embeddings or "lm_head.weight" not in weights.tensors:
        if not config.tie_word_embeddings:
            raise CheckpointError(
                "checkpoint has no 'lm_head.weight' and config.json does not tie embeddings"
            )
        weights.tensors.pop("lm_head.weight", None)
        yield "lm_head.weight", embed
    else:
        yield "lm_head.weight", weights.take("lm_head.weight", (config.vocab_size, h))
    _check_leftovers(weights)


def _fused(parts: list[Weight]) -> Weight:
    """Matrices stacked by rows (`cat_rows`), the file pages of the parts it copied dropped from
    resident memory (a part it keeps as it is, in a `MixedRows` or `PartedRows`, maps them again
    when it is packed)."""
    fused = cat_rows(parts)
    for part in parts:
        release_read(part)
    return fused


def _mlp_weights(weights: _Weights, src: str, dst: str, h: int, inter: int) -> dict[str, Weight]:
    """An MLP's gate|up (Phi-3's fused already, as weft fuses it) and down matrices."""
    if src + "gate_up_proj.weight" in weights.tensors:
        gate_up = weights.take(src + "gate_up_proj.weight", (2 * inter, h))
    else:
        gate = weights.take(src + "gate_proj.weight", (inter, h))
        gate_up = _fused([gate, weights.take(src + "up_proj.weight", (inter, h))])
    return {
        dst + "gate_up.weight": gate_up,
        dst + "down.weight": weights.take(src + "down_proj.weight", (h, inter)),
    }


def _expert_weights(
    weights: _Weights, src: str, dst: str, config: ModelConfig
) -> Iterator[tuple[str, Weight]]:
    """A mixture of experts' router and each expert's gate|up and down matrices, one expert at a
    time: Qwen2/3-MoE's and OLMoE's `mlp.gate` and `mlp.experts.{e}.{gate,up,down}_proj` (and
    Qwen2-MoE's `mlp.shared_expert` and `mlp.shared_expert_gate`), Mixtral's `block_sparse_moe.gate`
    and `block_sparse_moe.experts.{e}.w1` (gate), `w3` (up) and `w2` (down)."""
    h, inter, count = config.hidden_size, config.moe_intermediate_size, config.num_experts
    if src + "block_sparse_moe.gate.weight" in weights.tensors:  # Mixtral's names
        yield dst + "router.weight", weights.take(src + "block_sparse_moe.gate.weight", (count, h))
        for e in range(count):
            expert = f"{src}block_sparse_moe.experts.{e}."
            gate, up = (weights.take(expert + w, (inter, h)) for w in ("w1.weight", "w3.weight"))
            yield f"{dst}experts.{e}.gate_up.weight", _fused([gate, up])
            yield f"{dst}experts.{e}.down.weight", weights.take(expert + "w2.weight", (h, inter))
        return
    router = src + ("mlp.router." if src + "mlp.router.weight" in weights.tensors else "mlp.gate.")
    yield dst + "router.weight", weights.take(router + "weight", (count, h))
    if config.expert_bias:
        yield dst + "router.bias", weights.take(router + "bias", (count,))
    shared = config.shared_expert_intermediate_size
    if shared:  # Qwen2-MoE's shared expert and its gate
        shared_mlp = _mlp_weights(weights, src + "mlp.shared_expert.", dst + "shared_expert.", h, shared)
        yield from shared_mlp.items()
        yield dst + "shared_gate.weight", weights.take(src + "mlp.shared_expert_gate.weight", (1, h))
    if src + "mlp.experts.gate_up_proj" in weights.tensors:  # gpt-oss's experts, in three tensors each
        yield from _fused_experts(weights, src + "mlp.experts.", dst + "experts.", config).items()
        return
    for e in range(count):
        names = f"{src}mlp.experts.{e}.", f"{dst}experts.{e}."
        yield from _expert_mlp(weights, *names, h, inter).items()
        if config.expert_bias:
            yield from _expert_biases(weights, *names, h, inter).items()


def _expert_mlp(weights: _Weights, src: str, dst: str, h: int, inter: int) -> dict[str, Weight]:
    """An expert's gate|up and down matrices: where the load keeps experts in the file's blocks and
    their kinds allow, as `FileRows` (gate and up two parts, nothing copied), else as an MLP's."""
    names = [src + f"{p}_proj.weight" for p in ("gate", "up", "down")]
    if not weights.file_experts or not all(FileRows.holds(weights.tensors.get(n)) for n in names):
        return _mlp_weights(weights, src, dst, h, inter)
    gate, up = (cast(QuantizedRows, weights.take(n, (inter, h))) for n in names[:2])
    down = cast(QuantizedRows, weights.take(names[2], (h, inter)))
    return {dst + "gate_up.weight": FileRows((gate, up)), dst + "down.weight": FileRows((down,))}


def _expert_biases(weights: _Weights, src: str, dst: str, h: int, inter: int) -> dict[str, Weight]:
    """One expert's biases (gpt-oss from a GGUF file): gate|up's and down's."""
    gate, up = (weights.take(src + f"{p}_proj.bias", (inter,)) for p in ("gate", "up"))
    down = weights.take(src + "down_proj.bias", (h,))
    return {dst + "gate_up.bias": cat_rows([gate, up]), dst + "down.bias": down}


def _fused_experts(weights: _Weights, src: str, dst: str, config: ModelConfig) -> dict[str, Weight]:
    """gpt-oss's experts as transformers stores them: gate_up_proj [E, hidden, 2I] with gate and up
    columns interleaved (gate first), down_proj [E, I, hidden], and their biases."""
    h, inter, count = config.hidden_size, config.moe_intermediate_size, config.num_experts
    gate_up = _float(weights.take(src + "gate_up_proj", (count, h, 2 * inter)), src + "gate_up_proj")
    gate_up_bias = _float(weights.take(src + "gate_up_proj_bias", (count, 2 * inter)), src + "gate_up_bias")
    down = _float(weights.take(src + "down_proj", (count, inter, h)), src + "down_proj")
    down_bias = _float(weights.take(src + "down_proj_bias", (count, h)), src + "down_proj_bias")
    state: dict[str, Weight] = {}
    for e in range(count):
        rows = gate_up[e].t()  # [2I, hidden], gate and up rows interleaved
        state[f"{dst}{e}.gate_up.weight"] = torch.cat([rows[0::2], rows[1::2]]).contiguous()
        state[f"{dst}{e}.gate_up.bias"] = torch.cat([gate_up_bias[e][0::2], gate_up_bias[e][1::2]])
        state[f"{dst}{e}.down.weight"] = down[e].t().contiguous()  # [hidden, I]
        state[f"{dst}{e}.down.bias"] = down_bias[e]
    return state


def _float(weight: Weight, name: str) -> torch.Tensor:
    if not isinstance(weight, torch.Tensor):
        raise CheckpointError(f"{name}: experts in one tensor are read from float weights only")
    return weight


def _qkv_rows(weights: _Weights, src: str, config: ModelConfig) -> list[Weight]:
    """A layer's q, k and v matrices (Phi-3's fused qkv_proj cut in three), with q's and k's head
    dimensions reordered for a partial rotary embedding (`partial_rotary_order`)."""
    h, d = config.hidden_size, config.head_dim
    sizes = (config.num_heads * d, config.num_kv_heads * d, config.num_kv_heads * d)
    fused = src + "self_attn.qkv_proj.weight"
    if fused in weights.tensors:
        whole = weights.take(fused, (sum(sizes), h))
        if isinstance(whole, QuantizedRows):  # (a GGUF file's attn_qkv: its rows are whole blocks)
            split = torch.split(whole.rows, list(sizes))
            parts: list[Weight] = [QuantizedRows(whole.kind, rows) for rows in split]
        else:
            parts = list(torch.split(dequantized(whole), list(sizes)))
    else:
        parts = [
            weights.take(src + f"self_attn.{p}_proj.weight", (n, h))
            for p, n in zip("qkv", sizes, strict=True)
        ]
    rotary = rotary_dims(d, config.rope)
    if rotary == d:
        return parts
    order = partial_rotary_order(d, rotary)
    return [_heads_reordered(parts[0], order), _heads_reordered(parts[1], order), parts[2]]


def _heads_reordered(weight: Weight, order: torch.Tensor) -> Weight:  # [heads * D, in]
    """Each head's rows of a q or k matrix in `order` (a matrix in blocks: its rows of blocks)."""
    if isinstance(weight, QuantizedRows):
        return QuantizedRows(weight.kind, _rows_reordered(weight.rows, order))
    return _rows_reordered(dequantized(weight), order)


def _rows_reordered(rows: torch.Tensor, order: torch.Tensor) -> torch.Tensor:  # [heads * D, ...]
    head_dim = order.numel()
    return rows.view(-1, head_dim, rows.shape[-1])[:, order].reshape(rows.shape)


def _layer_norms(weights: _Weights, spec: DecoderSpec, src: str, dst: str, h: int) -> dict[str, Weight]:
    """A layer's norms: before attention and MLP, or (OLMo 2) after each, or (Gemma) both."""
    if spec.sandwich_norms:
        return {
            dst + "input_norm.weight": weights.take(src + "input_layernorm.weight", (h,)),
            dst + "attn_out_norm.weight": weights.take(src + "post_attention_layernorm.weight", (h,)),
            dst + "mlp_norm.weight": weights.take(src + "pre_feedforward_layernorm.weight", (h,)),
            dst + "mlp_out_norm.weight": weights.take(src + "post_feedforward_layernorm.weight", (h,)),
        }
    if spec.post_norms:
        return {
            dst + "attn_out_norm.weight": weights.take(src + "post_attention_layernorm.weight", (h,)),
            dst + "mlp_out_norm.weight": weights.take(src + "post_feedforward_layernorm.weight", (h,)),
        }
    return {
        dst + "input_norm.weight": weights.take(src + "input_layernorm.weight", (h,)),
        dst + "post_attn_norm.weight": weights.take(src + "post_attention_layernorm.weight", (h,)),
    }


def _check_leftovers(weights: _Weights) -> None:
    ignorable = ("rotary_emb.inv_freq",)
    leftovers = [n for n in weights.tensors if not n.endswith(ignorable)]
    if leftovers:
        shown = ", ".join(sorted(leftovers)[:5])
        raise CheckpointError(
            f"{weights.files[leftovers[0]]}: {len(leftovers)} tensors that this architecture does not use "
            f"(e.g. {shown}); is config.json for this checkpoint?"
        )


def load_config(model_dir: Source) -> ModelConfig:
    """config.json of a checkpoint directory, or the configuration in a GGUF file's metadata."""
    if isinstance(model_dir, GgufCheckpoint):
        return model_dir.model_config()
    if is_gguf(model_dir):
        return GgufCheckpoint(model_dir).model_config()
    path = model_dir / "config.json"
    if not path.is_file():
        raise ConfigError(f"{path}: file not found; a checkpoint directory needs config.json")
    return ModelConfig.from_file(path)
