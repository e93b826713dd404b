"""The operations whose implementation depends on the device, chosen once per device.

One object per device, chosen where the device is (`weft.engine.factory.kernels_for`), is what the
model's layers, its attention, the sampler and the grammar mask call for the operations every
device has (norms, rotary embedding, attention over the paged cache, activations, sampling and
masks); nothing else asks which device or which build it runs on. Each set does its whole job (a
faster set falls back to the plain one itself, never to its caller).

Not through this door: weights the loader has already put into weft's CPU layouts (float32 and
bfloat16 panels, int8 dot blocks; weft/model/layers.py, glu.py, quantized.py, loader.py) are packed
and multiplied by the native ops (`torch.ops.weft`) where they are held. Those layouts exist only
where the native set was chosen, so the choice was made once, at load.

- `TorchKernels`: plain torch operations, on any device and dtype. It is the reference the others
  are tested against (`tests/test_native.py`), and the fallback when weft's CPU kernels cannot be
  built (no C++ compiler) or are turned off (`WEFT_NATIVE=0`).
- `NativeCpuKernels`: weft's C++ kernels (`weft/native`) for CPU tensors: fused RMSNorm, rotary
  embedding in place, SiLU-and-multiply, decode attention that reads the paged cache in place, the
  grammar bitmask, and the float32 panel GEMM of every linear layer.

- `TritonKernels` (`weft/cuda/kernels.py`): Triton kernels for CUDA tensors: paged attention over
  every row of a step in one launch, fused RMSNorm (with the residual add), SiLU-and-multiply and
  rotary embedding. Chosen for CUDA devices when Triton imports (it ships with PyTorch's CUDA
  builds); `WEFT_KERNELS=torch` turns it off, `WEFT_KERNELS=triton` forces it (on CPU tensors it
  then needs Triton's interpreter, `TRITON_INTERPRET=1`: that is how CI tests it).
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from weft import ops
from weft.config import ConfigError, check_matmul_precision
from weft.kv_format import Q8_0, to_cache_rows


@dataclass(frozen=True, slots=True)
class RopeTables:
    """The rotation of one step's tokens, shared by all layers."""

    positions: torch.Tensor  # [T] int64
    cos: torch.Tensor  # the step's rows [T, 1, D/2] in x's dtype, or (native) the whole table [P, D/2]
    sin: torch.Tensor  # the same shape as cos


@dataclass(frozen=True, slots=True)
class RaggedBatch:
    """A step's sequences for an attention kernel that takes every row of a step in one call
    (`ragged_paged_attention`): on the device, built once per step, shared by all layers."""

    block_table: torch.Tensor  # [B, max_blocks] int32, padded with block 0
    seq_lens: torch.Tensor  # [B] int32, tokens of each sequence after this step
    query_start: torch.Tensor  # [B + 1] int32, the first step row of each sequence, then T
    max_query_len: int  # host value: sizes the kernel's grid
    window: int = 0  # a sliding-window layer's keys per query, itself included; 0: every earlier key


@dataclass(frozen=True, slots=True)
class DecodeRows:
    """A decode step's per-row inputs, or a captured graph's static buffers of them (`engine/graphs.py`):
    token ids, positions and sequence lengths (None: a sliding-window pool's rows, which share the
    main pool's), KV slots and the block table."""

    ids: torch.Tensor | None  # [B] int64
    positions: torch.Tensor | None  # [B] int64
    slots: torch.Tensor  # [B] int64
    table: torch.Tensor  # [B, width] int32
    lengths: torch.Tensor | None  # [B] int32


# GGUF block kinds weft keeps as they are -> (input features per block, bytes per block in the file)
GGUF_BLOCKS = {
    "q8_0": (32, 34),
    "q4_0": (32, 18),
    "q5_0": (32, 22),
    "q4_1": (32, 20),
    "q5_1": (32, 24),
    "q2_k": (256, 84),
    "q3_k": (256, 110),
    "q4_k": (256, 144),
    "q5_k": (256, 176),
    "q6_k": (256, 210),
    "iq4_nl": (32, 18),
    "iq4_xs": (256, 136),
    "mxfp4": (32, 17),
}


@dataclass(frozen=True, slots=True)
class BlockPart:
    """Rows `out_start` .. `out_start + rows` of a matrix kept in GGUF blocks of one `kind` (a key of
    `GGUF_BLOCKS`), at `byte_start` of its flat uint8 weight, `row_bytes` a row (`block_linear`): a
    fused q|k|v or gate|up of Q4_K and Q6_K rows is two parts."""

    kind: str
    out_start: int
    rows: int
    byte_start: int
    row_bytes: int


@dataclass(frozen=True, slots=True)
class PanelPart:
    """Rows `out_start` .. `out_start + rows` of a matrix in dot panels of `shape` [P, blocks, block
    bytes], at `start` of its flat int8 weight (weft/model/quantized.py: `PartedRows`)."""

    out_start: int
    rows: int
    start: int
    shape: tuple[int, int, int]


@dataclass(frozen=True, slots=True)
class StackShape:
    """What `decoder_stack_` needs to know of a model besides its weights."""

    sizes: tuple[int, int, int, int, int]  # heads, kv_heads, head_dim, hidden, intermediate
    eps: float  # RMSNorm epsilon
    scale: float  # attention scale
    bf16_dot: bool = False  # bfloat16 products in every matrix (`Linear.bf16_dot`)
    residual_scale: float = 1.0  # each branch's output times this before it joins the residual (Granite)
    # per layer, its rotary tables' index among the model's and the others' (-1: no rotation,
    # SmolLM3's NoPE layers); (): every layer the model's
    layer_rope: tuple[int, ...] = ()
    sandwich: bool = False  # each branch's output normed before the residual add (Gemma)
    gelu: bool = False  # GeGLU (Gemma), else SwiGLU
    softcap: float = 0.0  # attention scores soft-capped (Gemma 2); 0: none
    layer_window: tuple[int, ...] = ()  # per layer, the keys a query sees (0: all); (): no windows


@dataclass(frozen=True, slots=True)
class StackRouting:
    """How the stack's mixtures of experts route and multiply (`SparseMoE`'s settings); the defaults
    where the model has none."""

    top_k: int = 0  # experts per row
    normalize: bool = False  # their weights divided by their sum (`norm_topk_prob`)
    hidden: int = 0
    intermediate: int = 0  # a routed expert's columns
    shared_intermediate: int = 0  # the shared expert's (Qwen2-MoE), 0: none
    chunk_rows: int = 1  # rows routed at a time (`MOE_CHUNK_BYTES`)
    swiglu_limit: float = 0.0  # gpt-oss's clamped SwiGLU (`ModelConfig.swiglu_limit`); 0: plain SwiGLU
    swiglu_alpha: float = 1.702


@dataclass(frozen=True, slots=True)
class StackStep:
    """One step's inputs to `decoder_stack_` besides the residual stream: rows that each attend as
    one query."""

    slot_mapping: torch.Tensor  # [T] int64
    block_table: torch.Tensor  # [T, max_blocks] int64: row t is one query
    context_lens: torch.Tensor  # [T] int64, row t's context, itself included
    ropes: list[RopeTables]  # the model's rotation, then the other layers' (`StackShape.layer_rope`)
    # the sliding-window layers' slots, block table and context lengths (their own pool's, where
    # they have one); () where the model has no windows
    window: tuple[torch.Tensor, ...] = ()


class TorchKernels:
    """Plain torch: any device, any dtype."""

    name = "torch"
    # Rows of up to this many new tokens attend through `paged_decode_attention`, token by token;
    # longer ones (and all rows when it is unavailable) through SDPA over gathered blocks.
    max_tokenwise_query_len = 1
    # (tokens, context): where every query head has a KV head of its own, rows of up to `tokens`
    # new tokens whose context is at most `context` also attend token by token (None: no such rows)
    tokenwise_without_gqa: tuple[int, int] | None = None
    # ... and so do rows whose new tokens x context x query heads x head size is at most this
    # (None: no such rows)
    tokenwise_work_without_gqa: int | None = None
    # (group, most): where `group` or more query heads share each KV head, multi-token rows attend
    # token by token only while their new tokens times their context is at most `most`
    tokenwise_wide_gqa: tuple[int, int] | None = None
    # The MLP of a step with more rows runs this many at a time (None: all at once).
    mlp_chunk_rows: int | None = None

    def packs_linear_weights(self, device: torch.device, dtype: torch.dtype) -> bool:
        """Whether linear weights are packed into column panels for `packed_linear`."""
        return False

    # The GGUF block kinds `block_linear` multiplies (where `multiplies_blocks`); others are
    # dequantized at load.
    block_kinds: frozenset[str] = frozenset()

    def multiplies_blocks(self, device: torch.device) -> bool:
        """Whether linear layers on `device` keep quantized matrices in their GGUF blocks and
        multiply them through `block_linear` (else they are dequantized at load)."""
        return False

    def block_linear(
        self,
        x: torch.Tensor,  # [T, in]
        weight: torch.Tensor,  # [bytes] uint8, every part's rows of blocks
        parts: tuple[BlockPart, ...],
        out_features: int,
        bias: torch.Tensor | None,
    ) -> torch.Tensor:  # [T, out]
        """x times a matrix in GGUF blocks, dequantized as it streams (where `multiplies_blocks`)."""
        raise NotImplementedError(f"the {self.name} kernel set does not multiply GGUF blocks")

    def block_rows(
        self, weight: torch.Tensor, parts: tuple[BlockPart, ...], ids: torch.Tensor, dtype: torch.dtype
    ) -> torch.Tensor:  # [T, in]
        """Rows `ids` ([T] int64) of a matrix in GGUF blocks, dequantized (a quantized embedding)."""
        raise NotImplementedError(f"the {self.name} kernel set does not read GGUF blocks")

    def activation_dtype(self, device: torch.device, weight_dtype: torch.dtype) -> torch.dtype:
        """The dtype of activations and of the KV cache for a model whose weights are `weight_dtype`."""
        return weight_dtype

    def matmul_dtype(
        self, device: torch.device, weight_dtype: torch.dtype, requested: str | None, quantized: bool = False
    ) -> torch.dtype:
        """The dtype the linear layers' products multiply in (`matmul_precision`: "auto", "float32",
        "bfloat16" or "int8"; `quantized`: the checkpoint has quantized matrices). Plain torch
        multiplies in the weights' dtype (quantized ones dequantized at load), whatever is asked."""
        precision = check_matmul_precision(requested)
        if precision not in ("auto", dtype_name(weight_dtype)):
            raise ConfigError(
                f"matmul_precision={precision!r}: with the {self.name} kernels on {device.type} the matrix "
                f"products run in the weights' dtype ({dtype_name(weight_dtype)}); leave it 'auto' or "
                f"load the weights in {precision}"
            )
        return weight_dtype

    def describe(
        self, device: torch.device, weight_dtype: torch.dtype, matmul: torch.dtype | None = None
    ) -> dict[str, str]:
        """What runs a model on `device` in `weight_dtype` whose products multiply in `matmul` (None:
        the activations' dtype), for `LLM.kernels` and the load log line."""
        activations = self.activation_dtype(device, weight_dtype)
        return {
            "kernels": self.name,
            "weights": dtype_name(weight_dtype),
            "activations": dtype_name(activations),
            "matmul": dtype_name(matmul or activations),
            "linear": "torch F.linear"
            if device.type != "cpu" or weight_dtype != torch.float32
            else "torch x @ W",
        }

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:  # [..., dim]
        if x.dtype == torch.float32:
            return F.rms_norm(x, (x.shape[-1],), weight, eps)
        # Half precision: normalise in float32 as the reference implementations do.
        normed = F.rms_norm(x.float(), (x.shape[-1],), None, eps)
        return weight * normed.to(x.dtype)

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:  # [T, 2I] (gate | up) -> [T, I]
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up

    def gelu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:  # [T, 2I] (gate | up) -> [T, I]
        """GeGLU with tanh's GELU (Gemma)."""
        gate, up = gate_up.chunk(2, dim=-1)
        return F.gelu(gate, approximate="tanh").mul_(up)

    def rope_tables(
        self, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor, dtype: torch.dtype
    ) -> RopeTables:
        """cos, sin: [P, D/2] float32 tables; positions: [T] int64."""
        return RopeTables(
            positions, cos[positions].unsqueeze(1).to(dtype), sin[positions].unsqueeze(1).to(dtype)
        )

    def apply_rope_(self, x: torch.Tensor, rope: RopeTables) -> None:
        """Rotate x ([T, heads, D], a view into the fused q/k/v output) in place, rotate-half layout."""
        half = x.shape[-1] // 2
        x1, x2 = x[..., :half], x[..., half:]
        rotated1 = x1 * rope.cos - x2 * rope.sin
        x2.mul_(rope.cos).addcmul_(x1, rope.sin)
        x1.copy_(rotated1)

    def paged_decode_attention(
        self,
        q: torch.Tensor,  # [B, H, D], one query per sequence
        kv_cache: torch.Tensor,  # [num_blocks, block_size, 2, KVH, D]
        block_table: torch.Tensor,  # [B, max_blocks] int64
        context_lens: torch.Tensor,  # [B] int64
        scale: float,
        window: int = 0,
        sinks: torch.Tensor | None = None,  # [H] float32, each head's attention sink (gpt-oss)
        softcap: float = 0.0,  # scores -> softcap * tanh(score / softcap) (Gemma 2); 0: none
    ) -> torch.Tensor:  # [B, H, D]
        """Attention of one query per sequence over its cached keys and values (the last `window`
        of them in a sliding-window layer; 0: all), with each head's sink logit in the softmax's
        sum where given, read in place; only where
        `reads_cache_in_place` says so (otherwise attention gathers the blocks for SDPA)."""
        raise NotImplementedError(f"the {self.name} kernel set does not read the KV cache in place")

    def reads_cache_in_place(self, head_dim: int) -> bool:
        """Whether `paged_decode_attention` serves decode rows of this head size."""
        return False

    def paged_prefill_attention(
        self,
        q: torch.Tensor,  # [T, H, D], each sequence's queries in a run
        kv_cache: torch.Tensor,  # [num_blocks, block_size, 2, KVH, D]
        block_table: torch.Tensor,  # [B, max_blocks] int64
        context_lens: torch.Tensor,  # [B] int64
        query_start: torch.Tensor,  # [B + 1] int64: sequence b's are q[query_start[b] : query_start[b + 1]]
        scale: float,
        bf16_dot: bool = False,
        window: int = 0,
        sinks: torch.Tensor | None = None,  # [H] float32, as in `paged_decode_attention`
        softcap: float = 0.0,  # as in `paged_decode_attention`
    ) -> torch.Tensor:  # [T, H, D]
        """Causal attention of several queries per sequence (the last ones of its context) over its
        cached keys and values (in a sliding-window layer, the last `window` up to each query's
        own; 0: all), read in place; only where `prefills_in_place` says so (otherwise
        multi-token rows gather their blocks for SDPA). `bf16_dot`: q, k, the probabilities and v
        rounded to bfloat16 for the two products, float32 accumulation and softmax."""
        raise NotImplementedError(f"the {self.name} kernel set does not attend prefills in place")

    def prefills_in_place(self, head_dim: int) -> bool:
        """Whether `paged_prefill_attention` serves multi-token rows of this head size."""
        return False

    def takes_ragged_batch(self, head_dim: int, block_size: int) -> bool:
        """Whether `ragged_paged_attention` attends every row of a step in one call for this head
        size and cache block size (then the step's metadata is a `RaggedBatch`)."""
        return False

    def ragged_paged_attention(
        self,
        q: torch.Tensor,  # [T, H, D]
        kv_cache: torch.Tensor,  # [num_blocks, block_size, 2, KVH, D], the step's K/V already in it
        batch: RaggedBatch,
        scale: float,
        sinks: torch.Tensor | None = None,  # [H] float32, as in `paged_decode_attention`
        softcap: float = 0.0,  # as in `paged_decode_attention`
    ) -> torch.Tensor:  # [T, H, D]
        """Every new token of the step over its sequence's cache, causal within the step."""
        raise NotImplementedError(f"the {self.name} kernel set has no ragged_paged_attention")

    def add_rms_norm_(
        self, x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> torch.Tensor:
        """The residual add and the next norm: x += delta in place ([T, dim]); returns RMSNorm(x)."""
        x.add_(delta)
        return self.rms_norm(x, weight, eps)

    def add_normed_(
        self,
        x: torch.Tensor,
        delta: torch.Tensor,
        delta_weight: torch.Tensor,
        next_weight: torch.Tensor | None,
        eps: float,
    ) -> torch.Tensor:
        """A post-norm residual (Gemma, OLMo 2): x += RMSNorm(delta) in place ([T, dim]); returns the
        next branch's input, RMSNorm(x) with `next_weight`, else x."""
        x.add_(self.rms_norm(delta, delta_weight, eps))
        return x if next_weight is None else self.rms_norm(x, next_weight, eps)

    def write_kv_(
        self,
        kv_cache: torch.Tensor,  # [num_blocks, block_size, 2, KVH, D]
        kv: torch.Tensor,  # [T, 2, KVH, D]: the step's keys (rotated) and values
        slot_mapping: torch.Tensor,  # [T] int64
    ) -> None:
        """The step's keys and values into the cache at their slots."""
        num_blocks, block_size = kv_cache.shape[:2]
        kv_cache.view(num_blocks * block_size, *kv_cache.shape[2:]).index_copy_(
            0, slot_mapping, to_cache_rows(kv, kv_cache.dtype)
        )

    def rope_write_kv_(
        self,
        qkv: torch.Tensor,  # [T, H + 2 KVH, D]: heads q..., k..., v... of the fused projection
        num_heads: int,  # H
        rope: RopeTables,
        kv_cache: torch.Tensor,  # [num_blocks, block_size, 2, KVH, D]
        slot_mapping: torch.Tensor,  # [T] int64
    ) -> None:
        """Rotate q and k in place and write k and v into the cache at their slots (one launch
        where the kernel set fuses them; here the two steps)."""
        num_tokens, width, head_dim = qkv.shape
        num_kv = (width - num_heads) // 2
        self.apply_rope_(qkv[:, : num_heads + num_kv], rope)
        kv = qkv[:, num_heads:].view(num_tokens, 2, num_kv, head_dim)  # [T, 2, KVH, D]
        self.write_kv_(kv_cache, kv, slot_mapping)

    def has_decoder_stack(self, device: torch.device, activations: torch.dtype | None) -> bool:
        """Whether `decoder_stack_` runs on `device` with activations in `activations` (for
        Llama-family layers without q/k norms whose linear weights are packed into panels)."""
        return False

    def stack_weights(
        self, layers: list[torch.Tensor], experts: list[list[torch.Tensor]], routing: StackRouting
    ) -> object:
        """A whole stack's weights for `decoder_stack_`, held by the kernel once: each layer's in the
        kernel's order, and each layer's experts (`SparseMoE.stack_tensors`; [] for a layer with an
        MLP)."""
        raise NotImplementedError(f"the {self.name} kernel set has no decoder_stack_")

    def decoder_stack_(
        self,
        x: torch.Tensor,  # [T, hidden], updated in place
        weights: object,  # `stack_weights`
        kv_caches: list[torch.Tensor],
        step: StackStep,
        shape: StackShape,
    ) -> None:
        """Every decoder layer on rows that each attend as one query, in one call."""
        raise NotImplementedError(f"the {self.name} kernel set has no decoder_stack_")

    def top_by_value_then_index(self, x: torch.Tensor, num_top: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The `num_top` largest values of each row of x ([R, V]), ties to the smaller index, in that
        order: (ids [R, num_top] int64, values [R, num_top]). Plain torch: static shapes only."""
        num_rows, vocab_size = x.shape
        if num_top == 0:
            empty = x.new_empty(num_rows, 0)
            return empty.long(), empty
        clean = torch.nan_to_num(x, nan=float("-inf"))  # [R, V]
        kth = torch.topk(clean, num_top, dim=-1).values[:, -1:]  # [R, 1] the value at the cut
        below_id = vocab_size - torch.arange(vocab_size, device=x.device, dtype=torch.float32)  # [V]
        keys = torch.where(clean > kth, below_id + vocab_size, torch.where(clean == kth, below_id, 0.0))
        ids = torch.topk(keys, num_top, dim=-1).indices  # [R, num_top]: above the cut first, ids ascending
        order = torch.sort(clean.gather(1, ids), dim=-1, descending=True, stable=True).indices
        ids = ids.gather(1, order)
        return ids, x.gather(1, ids)

    def rank_of(self, x: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """[R] int64: 1 + the number of entries of each row of x ([R, V]) strictly greater than
        x[r, ids[r]] (ids: [R] int64)."""
        return (x > x.gather(1, ids[:, None])).sum(dim=-1) + 1

    def row_max(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x.max(dim=-1): each row's largest value and its first index ([B] each; a row with a NaN
        gives NaN and the first NaN's index)."""
        values, ids = x.max(dim=-1)
        return values, ids

    def stage_decode_rows(
        self, static: DecodeRows, step: DecodeRows, size: int, pad_block: int, block_size: int
    ) -> None:
        """Copy a decode step's rows (B = step's) into the first B rows of a captured graph's static
        buffers, and make rows B..size-1 padding rows: one token into block `pad_block`'s first
        slot, reading only it (table entry 0 that block, length 1)."""
        num_rows, width = step.table.shape
        pairs = [(static.slots, step.slots), (static.ids, step.ids), (static.positions, step.positions)]
        pairs.append((static.lengths, step.lengths))
        for dst, src in pairs:
            if dst is not None and src is not None:
                dst[:num_rows].copy_(src)
        static.table[:num_rows, :width].copy_(step.table)
        if num_rows == size:  # the batch fills the size: no padding rows (their launches saved)
            return
        static.slots[num_rows:size] = pad_block * block_size
        static.table[num_rows:size, 0] = pad_block
        if static.lengths is not None:
            static.lengths[num_rows:size] = 1

    def greedy_tokens(self, x: torch.Tensor, invalid: int) -> torch.Tensor:
        """[B] int64: each row's first largest value's index, `invalid` where the row holds a NaN
        or nothing above -inf."""
        maxima, ids = self.row_max(x)
        return ids.masked_fill(maxima.isnan() | (maxima == float("-inf")), invalid)

    def gumbel_argmax(
        self,
        logits: torch.Tensor,  # [B, V] float32
        seeds: torch.Tensor,  # [B] int64
        positions: torch.Tensor,  # [B] int64
    ) -> torch.Tensor:
        """[B] int64: one token per row from softmax(logits), by the Gumbel-max trick with noise
        keyed by (seed, position, token id) (`ops.gumbel_sample`, in tensor operations)."""
        return ops.gumbel_sample(logits, seeds, positions)

    def top_p_filter(self, logits: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
        """logits ([B, V] float32) with the tokens nucleus filtering removes (top_p [B] float32, 1 =
        keep all) set to -inf, as a new tensor (`ops.apply_top_p`)."""
        return ops.apply_top_p(logits, top_p)

    def row_logprobs(
        self,
        x: torch.Tensor,  # [R, V] float32 logits
        ids: torch.Tensor,  # [R] int64, the token of each row
        num_top: int,
        norm: torch.Tensor | None = None,  # [R] float32: logprobs are x - norm; None or NaN: log_softmax(x)
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(ids [R, k+1], logprobs [R, k+1], ranks [R]): column 0 is ids[r] with its logprob, then
        the `num_top` most likely tokens by logprob, then by id; rank = 1 + the number of tokens
        with a strictly higher logprob. A row whose `norm` is NaN takes its own log-softmax, the
        same numbers as with no `norm` at all."""
        logprobs = torch.log_softmax(x, dim=-1)  # [R, V]
        if norm is not None:
            logprobs = torch.where(norm.isnan()[:, None], logprobs, x - norm[:, None])
        chosen = logprobs.gather(1, ids[:, None])  # [R, 1]
        top_ids, top_values = self.top_by_value_then_index(logprobs, num_top)  # [R, k] each
        ranks = self.rank_of(logprobs, ids)
        return torch.cat([ids[:, None], top_ids], dim=1), torch.cat([chosen, top_values], dim=1), ranks

    def constraint_logmass(
        self,
        raw: torch.Tensor,  # [R, V] float32, the model's logits (at the row's temperature)
        masked: torch.Tensor,  # [B, V] float32, the logits after the grammar mask
        rows: torch.Tensor | None,  # [R] int64: raw row r's row of `masked` (None: the same row)
    ) -> torch.Tensor:  # [R] float32
        """log(sum of softmax(raw[r]) over the tokens the mask left above -inf): -inf where it left
        none, NaN where raw[r] holds a NaN."""
        allowed = (masked if rows is None else masked.index_select(0, rows)) > float("-inf")  # [R, V]
        on_allowed = torch.logsumexp(raw.masked_fill(~allowed, float("-inf")), dim=-1)
        return on_allowed - torch.logsumexp(raw, dim=-1)

    def apply_token_bitmask_(
        self, logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor | None
    ) -> None:
        """Set disallowed logits ([B, V] float32) to -inf in place. bitmask: [R, ceil(V / 32)] int32,
        bit j of word w allows token 32 * w + j; rows: [R] int64, the logits row of each bitmask row,
        or None when R == B. Unpacks the bits with tensor operations (no loop over rows or tokens)."""
        allowed = unpack_bitmask(bitmask.to(logits.device, non_blocking=True), logits.shape[-1])  # [R, V]
        if rows is None:
            logits.masked_fill_(~allowed, float("-inf"))
        else:
            logits[rows] = logits[rows].masked_fill(~allowed, float("-inf"))


# the KV caches the CPU kernels read and write beside float32 activations (`kv_cache_dtype`)
_CACHE_DTYPES = (torch.float32, torch.bfloat16, torch.float16, Q8_0)


class NativeCpuKernels(TorchKernels):
    """weft's C++ kernels for CPU tensors; anything they do not cover falls back to torch."""

    name = "native-cpu"
    # Rows of generated tokens (decode, forced, drafted: `StepPlan.generated_rows`) attend token by
    # token whatever their length, so that each token gets the numbers decoding gives it alone
    # (speculation and fast-forward change how many a row holds, never their values). The rules
    # below are for prompt rows (a short prompt, the rest of one after a cached prefix, a chunk).
    max_tokenwise_query_len = 8  # short prompt rows and chunks: token by token
    # ... and, without GQA: at 16 tokens and 256 of context
    # the decode kernel token by token costs what the prefill kernel does (51 against 50 us a
    # layer, 6 heads of 32), and the step stays in the fused stack (no per-layer Python); at 1,024
    # it costs 1.4x. With GQA the prefill kernel shares each KV head's tiles among its query heads
    # and is 2x faster already at 8 tokens (32 heads over 8: 323 against 157 us at 256).
    tokenwise_without_gqa = (16, 512)
    # ... and short prompts and long verifying steps: the bundled model's (8 layers, 6 heads of 32)
    # whole step, token by token in the fused stack against layer by layer, for a prompt of 20 / 32
    # / 48 / 64 / 128 tokens: 2.32 / 3.16 / 4.39 / 5.60 / 10.53 ms against 2.72 / 3.50 / 4.51 / 5.50
    # / 9.44 (the per-layer Python against attention that shares no tiles): up to 2,048 tokens x
    # context at 6 x 32, in proportion for wider heads
    tokenwise_work_without_gqa = 2048 * 6 * 32
    # ... and with 4 or more query heads per KV head the prefill kernel wins past short contexts: a
    # Llama-3.2-1B-shape step of 8 tokens after 1,024 took 79.8 ms token by token in the fused stack
    # against 65.0 through the prefill kernel (5 tokens: 64.3 / 56.4; after 2,048: 103 / 74; after
    # 256: 57.2 / 55.7), while SmolLM2-135M's 3 per KV head stay faster token by token to 2,048.
    # (Measured on verifying steps, which now attend token by token for exactness; the rule is
    # kept for prompt rows of up to 8 tokens after a long cached prefix.)
    tokenwise_wide_gqa = (4, 2048)
    # A long prefill's MLP in chunks: its [T, 2I] float32 intermediate stays in the last-level cache
    # and under glibc's 32 MiB limit for reusing freed memory (a larger one is mapped afresh at every
    # call: 13 ms of page faults per 50 MB on the Zen 4 machine, 4,096 rows of SmolLM2-135M).
    mlp_chunk_rows = 1024

    def packs_linear_weights(self, device: torch.device, dtype: torch.dtype) -> bool:
        return device.type == "cpu" and dtype in (torch.float32, torch.bfloat16, torch.float16)

    def activation_dtype(self, device: torch.device, weight_dtype: torch.dtype) -> torch.dtype:
        """float32 on CPU: half-precision weights are widened in registers as they stream in, so
        activations and the KV cache stay float32 (the checkpoint's numbers, computed exactly as a
        float32 load of it would, at half the bytes read per step)."""
        if self.packs_linear_weights(device, weight_dtype):
            return torch.float32
        return weight_dtype

    def matmul_dtype(
        self, device: torch.device, weight_dtype: torch.dtype, requested: str | None, quantized: bool = False
    ) -> torch.dtype:
        """float32 (x kept float32, half-precision and quantized weights widened exactly in
        registers) or, for bfloat16 weights, bfloat16 (x rounded to bfloat16 at each product,
        float32 accumulation: vdpbf16ps, at twice the arithmetic rate). "auto" takes bfloat16
        products where the CPU has AVX512_BF16 (docs/architecture.md, "Half precision on CPU");
        elsewhere they are emulated (slower than float32) and only taken when asked for. A quantized
        checkpoint's matrices multiply by int8 activations ("int8", and "auto": qdot.cpp, llama.cpp's
        arithmetic) unless "float32" asks for the exact product of the dequantized weights."""
        if not self.packs_linear_weights(device, weight_dtype):
            return super().matmul_dtype(device, weight_dtype, requested, quantized)
        precision = check_matmul_precision(requested)
        if precision == "int8" and not quantized:
            raise ConfigError(
                "matmul_precision='int8' multiplies quantized matrices (a GGUF file's Q8_0, Q4_K, Q6_K, "
                "Q5_0 or Q4_0 ones) by int8 activations, and this checkpoint has none; leave it 'auto'"
            )
        if quantized and precision in ("auto", "int8"):
            return torch.int8
        if precision == "bfloat16" and weight_dtype != torch.bfloat16:
            raise ConfigError(
                f"matmul_precision='bfloat16' needs bfloat16 weights, and this model loads "
                f"{dtype_name(weight_dtype)} weights; pass dtype='bfloat16' or leave matmul_precision 'auto'"
            )
        if precision == "auto":
            fast = weight_dtype == torch.bfloat16 and cpu_isa_path() == "avx512_bf16"
            return torch.bfloat16 if fast else torch.float32
        return torch.bfloat16 if precision == "bfloat16" else torch.float32

    def describe(
        self, device: torch.device, weight_dtype: torch.dtype, matmul: torch.dtype | None = None
    ) -> dict[str, str]:
        info = super().describe(device, weight_dtype, matmul)
        isa = cpu_isa_path()
        if self.packs_linear_weights(device, weight_dtype):
            info["linear"] = f"weft panels ({dtype_name(weight_dtype)})"
            if matmul == torch.bfloat16:
                how = "vdpbf16ps" if isa == "avx512_bf16" else "emulated: this CPU has no AVX512_BF16"
                what = "bfloat16 products (linear layers, prompt attention), float32 accumulation"
                info["matmul"] = f"{what} ({how})"
            elif matmul == torch.int8:
                info["matmul"] = (
                    "quantized matrices: int8 activations (rounded as llama.cpp rounds them) times their "
                    "quants, int32 sums "
                    f"({int8_dot_instructions()}); float32 elsewhere"
                )
            elif weight_dtype != torch.float32:
                info["matmul"] = f"float32 ({dtype_name(weight_dtype)} weights widened exactly)"
        info["isa"] = isa
        info["cpu"] = torch.ops.weft.build_info()  # the instruction sets of this build
        return info

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        if x.dim() == 2 and x.stride(1) == 1:
            return torch.ops.weft.rms_norm(x, weight, eps)
        if x.dim() > 2 and weight.dtype == x.dtype:  # per-head norms (q and k views of q|k|v: copied)
            return torch.ops.weft.rms_norm(x.reshape(-1, x.shape[-1]), weight, eps).view(x.shape)
        return super().rms_norm(x, weight, eps)

    def add_rms_norm_(
        self, x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> torch.Tensor:
        if x.dim() == 2 and x.is_contiguous() and delta.is_contiguous() and delta.dtype == x.dtype:
            return torch.ops.weft.add_rms_norm_(x, delta, weight, eps)  # one pass over each row
        return super().add_rms_norm_(x, delta, weight, eps)

    def add_normed_(
        self,
        x: torch.Tensor,
        delta: torch.Tensor,
        delta_weight: torch.Tensor,
        next_weight: torch.Tensor | None,
        eps: float,
    ) -> torch.Tensor:
        if x.dim() == 2 and x.is_contiguous() and delta.is_contiguous() and delta.dtype == x.dtype:
            return torch.ops.weft.add_normed_(x, delta, delta_weight, next_weight, eps)  # one pass a row
        return super().add_normed_(x, delta, delta_weight, next_weight, eps)

    def write_kv_(self, kv_cache: torch.Tensor, kv: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        if kv_cache.dtype in _CACHE_DTYPES and kv.dtype == torch.float32 and kv_cache.is_contiguous():
            # a row per token from the q|k|v output's rows, rounded to the cache's dtype (index_copy_ of
            # the strided rows: 1.8x the time)
            torch.ops.weft.write_kv_(kv_cache, kv, slot_mapping)
            return
        super().write_kv_(kv_cache, kv, slot_mapping)

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        if gate_up.dtype == torch.float32:
            return torch.ops.weft.silu_mul(gate_up)
        return super().silu_mul(gate_up)

    def gelu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        if gate_up.dtype == torch.float32 and gate_up.stride(-1) == 1:
            return torch.ops.weft.gelu_mul(gate_up)
        return super().gelu_mul(gate_up)

    def rope_tables(
        self, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor, dtype: torch.dtype
    ) -> RopeTables:
        return RopeTables(positions, cos, sin)  # the kernel looks the positions up itself

    def apply_rope_(self, x: torch.Tensor, rope: RopeTables) -> None:
        torch.ops.weft.rope_(x, rope.positions, rope.cos, rope.sin, x.shape[1])

    def paged_decode_attention(
        self,
        q: torch.Tensor,
        kv_cache: torch.Tensor,
        block_table: torch.Tensor,
        context_lens: torch.Tensor,
        scale: float,
        window: int = 0,
        sinks: torch.Tensor | None = None,
        softcap: float = 0.0,
    ) -> torch.Tensor:
        attend = torch.ops.weft.paged_decode_attention
        return attend(q, kv_cache, block_table, context_lens, scale, window, sinks, softcap)

    def reads_cache_in_place(self, head_dim: int) -> bool:
        return head_dim <= 256  # larger heads take the gather + SDPA path

    def paged_prefill_attention(
        self,
        q: torch.Tensor,
        kv_cache: torch.Tensor,
        block_table: torch.Tensor,
        context_lens: torch.Tensor,
        query_start: torch.Tensor,
        scale: float,
        bf16_dot: bool = False,
        window: int = 0,
        sinks: torch.Tensor | None = None,
        softcap: float = 0.0,
    ) -> torch.Tensor:
        attend = torch.ops.weft.paged_prefill_attention
        return attend(
            q, kv_cache, block_table, context_lens, query_start, scale, bf16_dot, window, sinks, softcap
        )

    def prefills_in_place(self, head_dim: int) -> bool:
        return head_dim in (16, 32, 64, 128, 256)  # the sizes weft/native/prefill_attention.cpp is built for

    def has_decoder_stack(self, device: torch.device, activations: torch.dtype | None) -> bool:
        return device.type == "cpu" and activations == torch.float32

    def stack_weights(
        self, layers: list[torch.Tensor], experts: list[list[torch.Tensor]], routing: StackRouting
    ) -> object:
        r = routing
        sizes = [r.top_k, int(r.normalize), r.hidden, r.intermediate, r.shared_intermediate, r.chunk_rows]
        flat = [t for layer in experts for t in layer]
        swiglu = [r.swiglu_limit, r.swiglu_alpha]
        return torch.classes.weft.StackWeights(layers, flat, [len(layer) for layer in experts], sizes, swiglu)

    def decoder_stack_(
        self,
        x: torch.Tensor,
        weights: object,
        kv_caches: list[torch.Tensor],
        step: StackStep,
        shape: StackShape,
    ) -> None:
        torch.ops.weft.decoder_stack_(
            x,
            weights,
            kv_caches,
            step.slot_mapping,
            step.block_table,
            step.context_lens,
            step.ropes[0].positions,
            [rope.cos for rope in step.ropes],
            [rope.sin for rope in step.ropes],
            list(shape.sizes),
            shape.eps,
            shape.scale,
            shape.bf16_dot,
            shape.residual_scale,
            list(shape.layer_rope),
            shape.sandwich,
            shape.gelu,
            shape.softcap,
            list(shape.layer_window),
            list(step.window),
        )

    def top_by_value_then_index(self, x: torch.Tensor, num_top: int) -> tuple[torch.Tensor, torch.Tensor]:
        """One pass over each row keeping a small sorted list (2 ms against 19 ms for the static-shape
        torch version at 64 x 49152)."""
        if x.dtype != torch.float32 or x.dim() != 2 or x.stride(1) != 1:
            return super().top_by_value_then_index(x, num_top)
        ids, _ = torch.ops.weft.top_by_value_then_index(x, num_top)
        return ids, x.gather(1, ids)

    def rank_of(self, x: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        if x.dtype != torch.float32 or x.dim() != 2 or x.stride(1) != 1:
            return super().rank_of(x, ids)
        return torch.ops.weft.rank_of(x, ids.contiguous())

    def row_max(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Two vector passes per row instead of torch's scalar loop (a row of 128k: 7 against 110 us)."""
        if x.dtype != torch.float32 or x.dim() != 2 or x.stride(1) != 1 or x.shape[1] == 0:
            return super().row_max(x)
        values, ids = torch.ops.weft.row_max(x)
        return values, ids

    def gumbel_argmax(
        self, logits: torch.Tensor, seeds: torch.Tensor, positions: torch.Tensor
    ) -> torch.Tensor:
        """One pass per row: the same keyed noise, computed only for tokens within reach of the
        row's largest logit (32 x 49152: 28 ms in tensor operations, which write four [B, V] int64
        temporaries)."""
        if logits.dtype != torch.float32 or logits.dim() != 2 or logits.stride(1) != 1:
            return super().gumbel_argmax(logits, seeds, positions)
        return torch.ops.weft.gumbel_argmax(logits, seeds.contiguous(), positions.contiguous())

    def top_p_filter(self, logits: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
        """No sort: the probabilities are bucketed by their float bits and only the bucket where
        the mass crosses top_p is sorted (32 x 49152: 69 ms for the sort-and-cumsum version)."""
        if logits.dtype != torch.float32 or logits.dim() != 2 or logits.stride(1) != 1:
            return super().top_p_filter(logits, top_p)
        return torch.ops.weft.top_p_filter(logits, top_p.float().contiguous())

    def row_logprobs(
        self, x: torch.Tensor, ids: torch.Tensor, num_top: int, norm: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """One kernel call: per row, the log-normalizer, then one pass for the rank and the top-n,
        the [R, V] log-softmax never written (at 64 x 49152 its write and two reads were most of
        the time)."""
        if x.dtype != torch.float32 or x.dim() != 2 or x.stride(1) != 1:
            return super().row_logprobs(x, ids, num_top, norm)
        empty = torch.empty(0, dtype=torch.float32)
        return torch.ops.weft.row_logprobs(
            x, ids.contiguous(), num_top, empty if norm is None else norm.contiguous()
        )

    def constraint_logmass(
        self, raw: torch.Tensor, masked: torch.Tensor, rows: torch.Tensor | None
    ) -> torch.Tensor:
        """One kernel call: per row, both maxima in one pass, then both sums of exponentials in
        another (64 x 49152: about 30 ms in tensor operations, which copy and mask the rows)."""
        if raw.dtype != torch.float32 or masked.dtype != torch.float32 or raw.stride(-1) != 1:
            return super().constraint_logmass(raw, masked, rows)
        empty = torch.empty(0, dtype=torch.int64)
        return torch.ops.weft.constraint_logmass(raw, masked, empty if rows is None else rows.contiguous())

    def apply_token_bitmask_(
        self, logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor | None
    ) -> None:
        """One kernel call, which skips words that allow all or none of their tokens."""
        if logits.dtype != torch.float32 or bitmask.device != logits.device:
            return super().apply_token_bitmask_(logits, bitmask, rows)
        empty = torch.empty(0, dtype=torch.int64)
        torch.ops.weft.apply_token_bitmask_(logits, bitmask, empty if rows is None else rows)
        return None


TORCH_KERNELS = TorchKernels()
NATIVE_CPU_KERNELS = NativeCpuKernels()


def cpu_isa_path() -> str:
    """The vector path weft's CPU kernels take on this machine (their build is for the machine's
    own -march): "avx512_bf16" (AVX-512 with vdpbf16ps), "avx512", "avx2" or "scalar"."""
    isa = torch.ops.weft.build_info().split()
    if "avx512_bf16" in isa:
        return "avx512_bf16"
    return "avx512" if "avx512f" in isa else "avx2" if "avx2" in isa else "scalar"


def int8_dot_instructions() -> str:
    """The byte dot product of this build's int8 products (weft/native/qdot.cpp)."""
    isa = torch.ops.weft.build_info().split()
    if "avx512_vnni" in isa:
        return "vpdpbusd"
    if "avx512bw" in isa or "avx2" in isa:
        return "vpmaddubsw + vpmaddwd: this CPU has no AVX512_VNNI"
    return "scalar: this build has no AVX2"


def triton_available() -> bool:
    """Whether Triton imports (it ships with PyTorch's CUDA builds)."""
    return importlib.util.find_spec("triton") is not None


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def unpack_bitmask(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[R, W] int32 -> [R, vocab_size] bool, True = allowed."""
    shifts = torch.arange(32, dtype=torch.int32, device=bitmask.device)  # [32]
    bits = (bitmask.unsqueeze(-1) >> shifts) & 1  # [R, W, 32]
    return bits.view(bitmask.shape[0], -1)[:, :vocab_size].bool()
