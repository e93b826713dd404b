"""The Llama family of decoders (Llama 2/3, TinyLlama, SmolLM, Mistral, Qwen2, Qwen3, Granite,
SmolLM3, OLMo 2, Phi-3, Gemma 3) over a paged KV cache. The families differ only in small switches,
gathered in `DecoderSpec`, and in values of their configuration:

- Qwen2 has biases on the q/k/v projections;
- Qwen3 normalises q and k per head (RMSNorm over head_dim) before the rotary embedding;
- Llama checkpoints with `attention_bias` have biases on q/k/v and o;
- Granite scales the embedding, each residual branch, the attention scores and the logits
  (`ModelConfig.embedding_multiplier`, ...);
- SmolLM3 leaves the rotary embedding out of every fourth layer (`ModelConfig.rope_layers`: those
  layers rotate by the tables of a rotary embedding of no dimensions, cos 1 and sin 0);
- OLMo 2 normalises q and k over all heads at once, and normalises each branch's output before the
  residual add instead of its input (`PostNormLayer`);
- Gemma 2 soft-caps its attention scores and logits (`ModelConfig.attn_logit_softcapping`, ...);
- Gemma 3 (and 2) normalises each branch's input and output (`PostNormLayer` with
  `DecoderSpec.sandwich_norms`), with norms that scale by
  (1 + w) (the loader adds the 1), q/k norms per head, GeGLU (tanh GELU) instead of SwiGLU, the
  embedding times sqrt(hidden), and sliding-window layers (`ModelConfig.layer_window`) with a rotary
  embedding of their own base (`ModelConfig.sliding_rope`); any family may slide its attention
  (Mistral, Phi-3: every layer).

Projections are fused: q, k and v into one [(H + 2 * KVH) * D, hidden] matrix, gate and up into
one [2 * intermediate, hidden] matrix.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, cast

import torch
from torch import nn

from weft.config import ModelConfig, RopeConfig
from weft.kernels import RopeTables, StackRouting, StackShape, StackStep, TorchKernels
from weft.model import glu
from weft.model.attention import AttentionMetadata, PagedAttention
from weft.model.layers import (
    BFloat16Pairs,
    Embedding,
    Linear,
    RMSNorm,
    RotaryEmbedding,
    StepRows,
    WeightLayout,
    num_rows,
)
from weft.model.moe import SparseMoE
from weft.model.prefill_gemm import Shape

if TYPE_CHECKING:
    from weft.parallel.group import TensorParallel

KVCache = torch.Tensor  # [num_blocks, block_size, 2, KVH, D]: keys and values
Reduce = Callable[[torch.Tensor], torch.Tensor]  # a row-parallel layer's sum over the ranks
GLU_CHUNK_BYTES = 64 << 20  # a fused gate|up's activation ([rows, I] as float32) bounded to this


def _alone(x: torch.Tensor) -> torch.Tensor:
    return x  # one rank: nothing to sum


@dataclass(frozen=True, slots=True)
class DecoderSpec:
    qkv_bias: bool = False
    o_bias: bool = False
    qk_norm: bool = False
    qk_norm_all_heads: bool = False  # q and k normalised as one vector of all their heads (OLMo 2)
    post_norms: bool = False  # each branch's output normalised before the residual add (OLMo 2)
    sandwich_norms: bool = False  # a norm before and after each branch (Gemma: `PostNormLayer`'s)
    norms_plus_one: bool = False  # checkpoints store each norm's scale less 1 (Gemma: x * (1 + w))


class Attention(nn.Module):
    def __init__(
        self, config: ModelConfig, spec: DecoderSpec, backend: PagedAttention, window: int = 0
    ) -> None:
        super().__init__()
        self.backend = backend
        self.window = window  # a sliding-window layer's keys per query (`ModelConfig.layer_window`); 0: all
        self.num_heads, self.num_kv_heads, self.head_dim = (
            config.num_heads,
            config.num_kv_heads,
            config.head_dim,
        )
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.scale = config.attention_multiplier or self.head_dim**-0.5
        self.qkv = Linear(config.hidden_size, self.q_size + 2 * self.kv_size, bias=spec.qkv_bias)
        self.o = Linear(self.q_size, config.hidden_size, bias=spec.o_bias)
        kernels = backend.kernels
        q_width, k_width = (self.q_size, self.kv_size) if spec.qk_norm_all_heads else (self.head_dim,) * 2
        self.q_norm = RMSNorm(q_width, config.rms_norm_eps, kernels) if spec.qk_norm else None
        self.k_norm = RMSNorm(k_width, config.rms_norm_eps, kernels) if spec.qk_norm else None
        self.norms_all_heads = spec.qk_norm_all_heads
        # gpt-oss's sink logit per head, in every softmax's sum with no value (None: no sinks)
        sinks = nn.Parameter(torch.zeros(self.num_heads), requires_grad=False)
        self.sinks = sinks if config.attention_sinks else None
        self.softcap = config.attn_logit_softcapping or 0.0  # Gemma 2's soft-capped scores; 0: none
        self.reduce: Reduce = _alone  # tensor parallel: the output projection's sum over the ranks

    def forward(
        self,
        x: torch.Tensor | BFloat16Pairs,  # [T, hidden]
        rope: RopeTables,
        kv_cache: KVCache,
        meta: AttentionMetadata,
        rows: StepRows | None = None,  # which rows may take the BLAS GEMM (`StepRows`)
    ) -> torch.Tensor:  # [T, hidden]
        num_tokens = num_rows(x)
        num_q, num_kv = self.num_heads, self.num_kv_heads
        qkv = self.qkv(x, rows).view(num_tokens, num_q + 2 * num_kv, self.head_dim)  # heads: q..., k..., v...
        if self.q_norm is not None and self.k_norm is not None:
            self._norm_qk(qkv, self.q_norm, self.k_norm)
        meta = meta.windowed(self.window)  # (a sliding-window layer's: its slots may be in a pool of its own)
        # q and k rotated in place, k and v into the cache: one launch where the kernel set fuses them
        self.backend.kernels.rope_write_kv_(qkv, num_q, rope, kv_cache, meta.slot_mapping)
        q = qkv[:, :num_q]  # [T, H, D]
        sinks = None if self.sinks is None else self.sinks.float()
        out = self.backend(q, None, kv_cache, meta, self.scale, sinks, self.softcap)
        return self.reduce(self.o(out, rows))

    def _norm_qk(self, qkv: torch.Tensor, q_norm: RMSNorm, k_norm: RMSNorm) -> None:
        """q and k normalised in place, per head or (OLMo 2) over all heads: qkv [T, H + 2 KVH, D]."""
        num_q, num_kv, num_tokens = self.num_heads, self.num_kv_heads, qkv.shape[0]
        q, k = qkv[:, :num_q], qkv[:, num_q : num_q + num_kv]
        if self.norms_all_heads:
            qkv[:, :num_q] = q_norm(q.reshape(num_tokens, -1)).view(num_tokens, num_q, -1)
            qkv[:, num_q : num_q + num_kv] = k_norm(k.reshape(num_tokens, -1)).view(num_tokens, num_kv, -1)
            return
        qkv[:, :num_q] = q_norm(q)
        qkv[:, num_q : num_q + num_kv] = k_norm(k)


class MLP(nn.Module):
    def __init__(self, config: ModelConfig, kernels: TorchKernels) -> None:
        super().__init__()
        self.kernels = kernels
        self.gate_up = Linear(config.hidden_size, 2 * config.intermediate_size)
        self.down = Linear(config.intermediate_size, config.hidden_size)
        self.reduce: Reduce = _alone  # tensor parallel: the down projection's sum over the ranks
        self.gelu = config.hidden_act == "gelu_pytorch_tanh"  # GeGLU (Gemma), else SwiGLU

    def forward(
        self, x: torch.Tensor | BFloat16Pairs, rows: StepRows | None = None
    ) -> torch.Tensor:  # [T, hidden]
        if isinstance(x, BFloat16Pairs):  # its norm rounded it for the fused MLP (`takes_pairs`)
            return self.reduce(glu.glu_down(self.gate_up, self.down, x))
        chunk = self._chunk_rows()
        if chunk is None or x.shape[0] <= chunk:
            return self._forward(x, rows)
        out = x.new_empty(x.shape[0], self.down.out_features)  # [T, hidden]
        for start in range(0, x.shape[0], chunk):  # a long prefill: [chunk, 2I] at a time
            stop = min(start + chunk, x.shape[0])
            out[start:stop] = self._forward(x[start:stop], None if rows is None else rows.slice(start, stop))
        return out

    def _fuses(self) -> bool:
        """Whether the MLP runs fused (glu.py, whose activation is SiLU)."""
        return not self.gelu and glu.fuses(self.gate_up, self.down)

    def takes_pairs(self, num_tokens: int) -> bool:
        """Whether an input of this many rows may come as bfloat16 pairs: the MLP runs fused (glu.py)
        and in one chunk."""
        rows = self._chunk_rows()
        return self._fuses() and (rows is None or num_tokens <= rows)

    def _chunk_rows(self) -> int | None:
        """Rows of a long prefill's MLP at a time: the kernels' chunk, whose [rows, 2I] product stays
        in the last-level cache; where gate|up runs fused with its activation (glu.py) there is no
        such product, and the chunk only bounds the activation (unchunked, a 32 x 128-token prefill
        of SmolLM2-135M was 1.5% faster than in chunks of 1,024 rows)."""
        rows = self.kernels.mlp_chunk_rows
        if rows is None or not self._fuses():
            return rows
        return max(rows, GLU_CHUNK_BYTES // (4 * self.down.in_features))

    def _forward(self, x: torch.Tensor, rows: StepRows | None) -> torch.Tensor:  # [T, hidden]
        if self._fuses():  # bfloat16 products: in two passes (weft/model/glu.py)
            return self.reduce(glu.glu_down(self.gate_up, self.down, x))
        gate_up = self.gate_up(x, rows)  # [T, 2I]: gate | up
        act = self.kernels.gelu_mul(gate_up) if self.gelu else self.kernels.silu_mul(gate_up)  # [T, I]
        return self.reduce(self.down(act, rows))  # [T, hidden]


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, spec: DecoderSpec, backend: PagedAttention, index: int) -> None:
        super().__init__()
        kernels = backend.kernels
        self.input_norm = RMSNorm(config.hidden_size, config.rms_norm_eps, kernels)
        self.attn = Attention(config, spec, backend, config.layer_window(index))
        self.post_attn_norm = RMSNorm(config.hidden_size, config.rms_norm_eps, kernels)
        self.mlp: MLP | SparseMoE = (
            SparseMoE(config, kernels) if config.layer_has_experts(index) else MLP(config, kernels)
        )
        self.residual_multiplier = config.residual_multiplier  # Granite's; 1 elsewhere

    def forward(
        self,
        x: torch.Tensor,  # [T, hidden], the residual stream, updated in place
        normed: torch.Tensor | BFloat16Pairs,  # [T, hidden], input_norm(x)
        next_norm: RMSNorm,  # the next layer's input norm, or the model's final norm
        rope: RopeTables,
        kv_cache: KVCache,
        meta: AttentionMetadata,
        pairs: tuple[bool, bool] = (False, False),  # the MLP's input, next_norm's output as pairs
        rows: StepRows | None = None,  # which rows may take the BLAS GEMM (`StepRows`)
    ) -> torch.Tensor | BFloat16Pairs:  # [T, hidden], next_norm(x) after this layer
        delta = self._scaled(self.attn(normed, rope, kv_cache, meta, rows))
        post = self.post_attn_norm
        normed = post.pairs_(x, delta) if pairs[0] else post.add_residual_(x, delta)
        delta = self._scaled(self.mlp(normed, rows))
        return next_norm.pairs_(x, delta) if pairs[1] else next_norm.add_residual_(x, delta)

    def _scaled(self, delta: torch.Tensor) -> torch.Tensor:  # [T, hidden], a branch's output
        return delta if self.residual_multiplier == 1.0 else delta.mul_(self.residual_multiplier)

    def takes_pairs(self, num_tokens: int) -> bool:
        """Whether both norms may hand bfloat16 pairs to the products after them (`BFloat16Pairs`):
        q|k|v and a fused MLP with bfloat16 products, float32 norms."""
        norms = (self.input_norm.weight, self.post_attn_norm.weight)
        float_norms = all(w.dtype == torch.float32 and w.device.type == "cpu" for w in norms)
        return self.attn.qkv.bf16_dot and float_norms and self.mlp.takes_pairs(num_tokens)


class PostNormLayer(nn.Module):
    """OLMo 2's layer: attention and MLP read the residual stream as it is, and each one's output is
    normalised before it is added back; Gemma's (`DecoderSpec.sandwich_norms`) normalises each
    branch's input too, a norm before and a norm after each branch."""

    def __init__(self, config: ModelConfig, spec: DecoderSpec, backend: PagedAttention, index: int) -> None:
        super().__init__()
        kernels, h, eps = backend.kernels, config.hidden_size, config.rms_norm_eps
        self.input_norm = RMSNorm(h, eps, kernels) if spec.sandwich_norms else None
        self.attn = Attention(config, spec, backend, config.layer_window(index))
        self.attn_out_norm = RMSNorm(h, eps, kernels)
        self.mlp_norm = RMSNorm(h, eps, kernels) if spec.sandwich_norms else None
        self.mlp = MLP(config, kernels)
        self.mlp_out_norm = RMSNorm(h, eps, kernels)

    def forward(
        self,
        x: torch.Tensor,  # [T, hidden], the residual stream, updated in place
        branch_in: torch.Tensor,  # [T, hidden], input_norm(x), or x itself (OLMo 2)
        next_norm: RMSNorm | None,  # the next layer's input norm (None: it has none), or the final norm
        rope: RopeTables,
        kv_cache: KVCache,
        meta: AttentionMetadata,
        rows: StepRows | None = None,
    ) -> torch.Tensor:  # [T, hidden], the next branch's input: next_norm(x) after this layer, or x
        attn = self.attn(branch_in, rope, kv_cache, meta, rows)
        branch_in = self.attn_out_norm.add_normed_(x, attn, self.mlp_norm)  # x += norm(attn); mlp_norm(x)
        return self.mlp_out_norm.add_normed_(x, self.mlp(branch_in, rows), next_norm)

    def takes_pairs(self, num_tokens: int) -> bool:
        return False  # its products read the residual stream or a norm's float output


class LlamaForCausalLM(nn.Module):
    def __init__(
        self, config: ModelConfig, spec: DecoderSpec, max_positions: int, kernels: TorchKernels
    ) -> None:
        super().__init__()
        self.config = config
        self.kernels = kernels  # the device's kernel set, chosen once at load
        self.activation_dtype: torch.dtype | None = None  # None: the embedding's dtype (set at load)
        self.stack: object | None = None  # the whole stack's weights for one kernel call (`stack_weights`)
        # (in, out, dtype) -> rows from which a panel-packed Linear takes the BLAS GEMM (set at load)
        self.dense_rows: dict[Shape, int] = {}
        self.bf16_dot = False  # bfloat16 products in every packed matrix (set at load)
        self.norm_pairs = False  # the norms may write bfloat16 pairs (`_norms_write_pairs`; set at load)
        self.huge_page_bytes = 0  # the packed weights moved into 2 MB pages at load (huge_pages.py)
        group = config.num_heads // config.num_kv_heads
        window = max(config.layer_window(i) for i in range(config.num_layers))
        self.attention = PagedAttention(kernels, config.head_dim, group, config.num_heads, window)
        self.embed = Embedding(config.vocab_size, config.hidden_size)
        layer = PostNormLayer if spec.post_norms or spec.sandwich_norms else DecoderLayer
        self.layers = nn.ModuleList(layer(config, spec, self.attention, i) for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, kernels)
        # the rotary embeddings of the layers: the model's, and where some layers rotate otherwise
        # (SmolLM3's without, Gemma's sliding-window layers with their own base) theirs; `rotaries[i]`
        # is layer i's index among them
        self.rotary = RotaryEmbedding(config.head_dim, max_positions, config.rope, kernels=kernels)
        self.other_rotaries: list[RotaryEmbedding] = []
        self.rotaries: list[int] = []
        self.build_rotaries(max_positions)
        self.lm_head = Linear(
            config.hidden_size, config.vocab_size
        )  # tied: shares embed.weight, or a copy of it in a CPU layout (`WeightLayout`)
        # Tensor parallel (weft/parallel/shard.py): `config` is this rank's part (heads, MLP columns,
        # vocabulary rows from `vocab_start`), and the layers that split their inputs sum over `tp`.
        self.tp: TensorParallel | None = None
        self.vocab_start = 0

    def shard(self, tp: TensorParallel, vocab_start: int) -> None:
        """Make this model one rank's part of a tensor-parallel model."""
        self.tp, self.vocab_start = tp, vocab_start
        for layer in self.layers:
            layer = cast(DecoderLayer, layer)
            layer.attn.reduce = tp.all_reduce_
            layer.mlp.reduce = tp.all_reduce_

    def forward(
        self,
        input_ids: torch.Tensor,  # [T] int64
        positions: torch.Tensor,  # [T] int64
        kv_caches: list[KVCache],
        meta: AttentionMetadata,
        rows: StepRows | None = None,  # which rows may take the BLAS GEMM (None: all, as in scoring)
    ) -> torch.Tensor:  # [T, hidden], final-normed hidden states
        x = self._embed(input_ids)  # [T, hidden]
        tables = self._rope_tables(positions, x.dtype)
        rope, ropes = tables[0], [tables[i] for i in self.rotaries] or None
        step = self._stack_step(meta, tables) if self.stack is not None else None
        if self.stack is not None and step is not None:
            self.kernels.decoder_stack_(x, self.stack, kv_caches, step, self._shape)
            return self.norm(x)
        if isinstance(self.layers[0], PostNormLayer):
            layer_ropes = ropes or [rope] * len(self.layers)
            return self._post_norm_layers(x, layer_ropes, kv_caches, meta, rows)
        layers = cast(list[DecoderLayer], list(self.layers))
        next_norms = [layer.input_norm for layer in layers[1:]] + [self.norm]
        pairs = self._norms_write_pairs(x.shape[0])
        normed = layers[0].input_norm.pairs_(x) if pairs else layers[0].input_norm(x)
        last = len(layers) - 1
        for i, (layer, next_norm, kv_cache) in enumerate(zip(layers, next_norms, kv_caches, strict=True)):
            layer_rope = rope if ropes is None else ropes[i]
            normed = layer(
                x, normed, next_norm, layer_rope, kv_cache, meta, (pairs, pairs and i < last), rows
            )
        return cast(torch.Tensor, normed)  # the final norm's output is float

    def _post_norm_layers(
        self,
        x: torch.Tensor,  # [T, hidden]
        ropes: list[RopeTables],
        kv_caches: list[KVCache],
        meta: AttentionMetadata,
        rows: StepRows | None,
    ) -> torch.Tensor:  # [T, hidden], final-normed hidden states
        """OLMo 2's and Gemma's layers, each branch's output normed into the residual stream
        together with the next branch's input norm (`RMSNorm.add_normed_`)."""
        layers = cast(list[PostNormLayer], list(self.layers))
        norms = [layer.input_norm for layer in layers[1:]] + [self.norm]
        branch_in = x if layers[0].input_norm is None else layers[0].input_norm(x)
        for layer, norm, rope, kv_cache in zip(layers, norms, ropes, kv_caches, strict=True):
            branch_in = layer(x, branch_in, norm, rope, kv_cache, meta, rows)
        return branch_in

    def build_rotaries(self, max_positions: int, device: torch.device | None = None) -> None:
        """The rotary embeddings' tables on `device` (the loader builds the model on the meta device)."""
        config, kernels = self.config, self.kernels
        self.rotary = RotaryEmbedding(config.head_dim, max_positions, config.rope, device, kernels)
        ropes = [_layer_rope(config, i) for i in range(config.num_layers)]
        others = [rope for rope in dict.fromkeys(ropes) if rope != config.rope]
        dim = config.head_dim
        self.other_rotaries = [RotaryEmbedding(dim, max_positions, r, device, kernels) for r in others]
        kinds = [config.rope, *others]
        self.rotaries = [kinds.index(rope) for rope in ropes] if others else []

    def _rope_tables(self, positions: torch.Tensor, dtype: torch.dtype) -> list[RopeTables]:
        """The step's rotations: the model's, then those of the layers that rotate otherwise
        (`rotaries[i]` is layer i's index among them)."""
        rope = self.rotary.tables(positions, dtype)
        return [rope] + [other.tables(positions, dtype) for other in self.other_rotaries]

    def _stack_step(self, meta: AttentionMetadata, tables: list[RopeTables]) -> StackStep | None:
        """The fused stack's inputs where every row of the step attends as one query, else None."""
        group = meta.decode_group
        if group is None:
            return None
        window: tuple[torch.Tensor, ...] = ()
        if meta.sliding is not None:  # the sliding-window layers' step
            sliding = meta.sliding.decode_group
            if sliding is None:
                return None
            window = (meta.sliding.slot_mapping, sliding.block_table, sliding.context_lens)
        return StackStep(meta.slot_mapping, group.block_table, group.context_lens, tables, window)

    def _norms_write_pairs(self, num_tokens: int) -> bool:
        """Whether this step's norms write bfloat16 pairs for the products after them (every layer
        `takes_pairs`, checked at load; the MLP's chunking, per step)."""
        first = cast(DecoderLayer | PostNormLayer, self.layers[0])
        return self.norm_pairs and self.tp is None and first.mlp.takes_pairs(num_tokens)

    def _embed(self, input_ids: torch.Tensor) -> torch.Tensor:  # [T] int64 -> [T, hidden]
        if self.tp is None:
            x = self.embed(input_ids)
            # half-precision weights, float32 activations (CPU kernels)
            x = x if self.activation_dtype is None else x.to(self.activation_dtype)
            return self._embedding_scaled(x)
        local = input_ids - self.vocab_start  # [T]: this rank's rows, the others read as zeros
        outside = (local < 0) | (local >= self.config.vocab_size)
        x = self.embed(local.masked_fill(outside, 0))
        x = x.to(self.activation_dtype or x.dtype).masked_fill(outside[:, None], 0.0)
        return self._embedding_scaled(self.tp.all_reduce_(x))

    def _embedding_scaled(self, x: torch.Tensor) -> torch.Tensor:  # [T, hidden]
        multiplier = self.config.embedding_multiplier  # Granite's; 1 elsewhere
        return x if multiplier == 1.0 else x * multiplier

    def fuse_stack(self) -> None:
        """Let steps whose rows each attend as one query (decode) run every layer in one call of the
        kernel set's `decoder_stack_`, where it has one and the layers fit it."""
        layers = cast(list[DecoderLayer | PostNormLayer], list(self.layers))
        device = self.lm_head.weight.device
        if not self.config.fits_decoder_stack:
            return  # (the kernel has no such layers)
        if not self.kernels.has_decoder_stack(device, self.activation_dtype):
            return
        if not all(_stackable(layer) for layer in layers) or self.tp is not None:
            return  # (tensor parallel: the layers sum over the ranks between the kernel's steps)
        c = self.config
        windows = [c.layer_window(i) for i in range(c.num_layers)]
        if len(set(windows) - {0}) > 1:
            return  # (one window for every sliding layer: the step's `sliding` metadata)
        experts = [layer.mlp.stack_tensors() if isinstance(layer.mlp, SparseMoE) else [] for layer in layers]
        weights = [weight for layer in layers for weight in _stack_weights(layer)]
        self.stack = self.kernels.stack_weights(weights, experts, self._stack_routing())
        self._shape = StackShape(
            sizes=(c.num_heads, c.num_kv_heads, c.head_dim, c.hidden_size, c.intermediate_size),
            eps=c.rms_norm_eps,
            scale=layers[0].attn.scale,
            bf16_dot=self.bf16_dot,
            residual_scale=c.residual_multiplier,
            layer_rope=self._stack_ropes(),
            sandwich=isinstance(layers[0], PostNormLayer),
            gelu=c.hidden_act == "gelu_pytorch_tanh",
            softcap=c.attn_logit_softcapping or 0.0,
            layer_window=tuple(windows) if any(windows) else (),
        )

    def _stack_routing(self) -> StackRouting:
        """How the stack's mixtures of experts route (the defaults where the model has none)."""
        c = self.config
        moe = next((layer.mlp for layer in self.layers if isinstance(layer.mlp, SparseMoE)), None)
        if moe is None:
            return StackRouting()
        return StackRouting(
            top_k=c.experts_per_token,
            normalize=c.norm_topk_prob,
            hidden=c.hidden_size,
            intermediate=c.moe_intermediate_size,
            shared_intermediate=c.shared_expert_intermediate_size,
            chunk_rows=moe.chunk_rows(c.hidden_size),
            swiglu_limit=c.swiglu_limit or 0.0,
            swiglu_alpha=c.swiglu_alpha,
        )

    def _stack_ropes(self) -> tuple[int, ...]:
        """Each layer's rotation for the fused stack: its index among the step's tables, -1 for a
        layer without rotary embedding (SmolLM3's); () where every layer rotates by the model's."""
        rope_layers = self.config.rope_layers
        ropes = tuple(
            -1 if rope_layers and not rope_layers[i] else (self.rotaries[i] if self.rotaries else 0)
            for i in range(self.config.num_layers)
        )
        return ropes if any(ropes) else ()

    def set_bf16_dot(self, bf16_dot: bool) -> None:
        """Every matrix in bfloat16 panels multiplies with bfloat16 products, or none does (others,
        such as Q8_0 panels, keep theirs)."""
        self.bf16_dot = bf16_dot
        self.attention.bf16_dot = bf16_dot  # prefill attention's two products too
        for module in self.modules():
            if isinstance(module, Linear):
                module.bf16_dot = bf16_dot and module.weight.dtype == torch.bfloat16
        layers = cast(list[DecoderLayer | PostNormLayer], list(self.layers))
        self.norm_pairs = bf16_dot and all(layer.takes_pairs(1) for layer in layers)

    def quantized_matrices(self) -> dict[str, int]:
        """How many matrices run from each quantized panel type ("q8_0": n)."""
        kinds = [m.quantized for m in self.modules() if isinstance(m, Linear) and m.quantized]
        return {kind: kinds.count(kind) for kind in sorted(set(kinds))}

    @property
    def keeps_blocks(self) -> bool:
        """Whether quantized matrices stay in their GGUF blocks (`WeightLayout.BLOCKS`)."""
        return any(isinstance(m, Linear) and m.blocks is not None for m in self.modules())

    def compute_logits(
        self, hidden: torch.Tensor, rows: StepRows | None = None
    ) -> torch.Tensor:  # [N, hidden] -> [N, V] float32
        """Tensor parallel: each rank's vocabulary range, gathered on rank 0 (the others get theirs).
        `rows`: `GENERATED_ROWS` for sampling rows, whose logits never take the BLAS GEMM."""
        logits = self.lm_head(hidden, rows).float()
        if self.config.logits_scaling != 1.0:  # Granite's
            logits.div_(self.config.logits_scaling)
        cap = self.config.final_logit_softcapping
        if cap is not None:  # Gemma 2's: c * tanh(logits / c)
            logits.div_(cap).tanh_().mul_(cap)
        return logits if self.tp is None else self.tp.gather_columns(logits)


def _layer_rope(config: ModelConfig, layer: int) -> RopeConfig:
    """Layer `layer`'s rotary embedding: none (SmolLM3's NoPE layers: a rotary embedding of no
    dimensions, q and k exactly as they are), the sliding-window layers' own (Gemma), or the model's."""
    if config.rope_layers and not config.rope_layers[layer]:
        return RopeConfig(config.rope.theta, partial_rotary_factor=0.0)
    if config.sliding_rope is not None and config.layer_window(layer):
        return config.sliding_rope
    return config.rope


def _stackable(layer: DecoderLayer | PostNormLayer) -> bool:
    """Llama's layer, or Gemma's with a norm before and after each branch; per-head q/k norms or
    none, a head size the attention kernel takes, every matrix packed into panels; an MLP or experts
    the stack runs (`SparseMoE.stackable`)."""
    attn, mlp = layer.attn, layer.mlp
    if isinstance(mlp, SparseMoE) and not mlp.stackable():
        return False
    if isinstance(layer, PostNormLayer) and (layer.input_norm is None or layer.mlp_norm is None):
        return False  # (OLMo 2's layer: its branches read the residual stream itself)
    dense = (mlp.gate_up, mlp.down) if isinstance(mlp, MLP) else ()
    matrices = (attn.qkv, attn.o, *dense)
    packed = all(lin.layout is WeightLayout.PANELS for lin in matrices)
    whole = all(lin.parts is None for lin in matrices[1:]) and len(attn.qkv.parts or ()) <= 2
    return not attn.norms_all_heads and attn.head_dim <= 256 and packed and whole


def _stack_weights(layer: DecoderLayer | PostNormLayer) -> list[torch.Tensor]:
    """One layer's weights in the order of `decoder_stack_` (weft/native/decoder.cpp)."""
    attn, empty = layer.attn, torch.empty(0)
    # the MLP's matrices, Qwen2-MoE's shared expert's beside its routed ones, or none
    mlp = layer.mlp.shared_expert if isinstance(layer.mlp, SparseMoE) else layer.mlp
    qkv = [panels for panels, _ in attn.qkv.part_panels()] if attn.qkv.parts else [attn.qkv.weight]
    after: list[torch.Tensor]
    if isinstance(layer, PostNormLayer):  # a norm before and after each branch (Gemma)
        assert layer.input_norm is not None and layer.mlp_norm is not None
        before = (layer.input_norm.weight, layer.mlp_norm.weight)
        after = [layer.attn_out_norm.weight, layer.mlp_out_norm.weight]
    else:
        before, after = (layer.input_norm.weight, layer.post_attn_norm.weight), [empty, empty]
    return [
        before[0],
        *qkv,
        *([empty] * (2 - len(qkv))),  # a fused q/k/v in one dot layout, or in two parts (`PartedRows`)
        empty if attn.qkv.bias is None else attn.qkv.bias,
        attn.o.weight,
        empty if attn.o.bias is None else attn.o.bias,
        before[1],
        empty if mlp is None else mlp.gate_up.weight,
        empty if mlp is None else mlp.down.weight,
        empty if attn.q_norm is None else attn.q_norm.weight,
        empty if attn.k_norm is None else attn.k_norm.weight,
        *after,
        empty if attn.sinks is None else attn.sinks.float(),
    ]
