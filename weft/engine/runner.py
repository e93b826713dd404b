"""The model runner: owns the KV tensors, turns a `SchedulerOutput` into model inputs, runs the
forward pass and returns the logits of the rows that sample this step."""

from __future__ import annotations

import math
import mmap
from dataclasses import dataclass, field

import numpy as np
import torch

from weft.arrays import StepUploads, Upload, column, to_device
from weft.config import CacheConfig, ModelConfig
from weft.engine.graphs import Capture, CaptureReport, DecodeGraphs
from weft.engine.layout import ScheduledSequence, SchedulerOutput
from weft.engine.sequence import Sequence
from weft.model.attention import AttentionMetadata, PagedAttention
from weft.model.layers import GENERATED_ROWS, Linear, StepRows
from weft.model.llama import KVCache, LlamaForCausalLM
from weft.sample.prompt_logprobs import CHUNK_ROWS as PROMPT_CHUNK_ROWS


@dataclass(frozen=True, slots=True)
class KnownSpan:
    """Known tokens whose logprobs this step computes, prompt tokens or tokens a grammar forced:
    tokens `first_token`.. of `seq`, predicted by the hidden states of the `count` step rows
    before them."""

    seq: Sequence
    first_token: int
    count: int
    forced: bool = False  # tokens a grammar forced (fast-forward), not prompt tokens

    @property
    def num_top(self) -> int:
        """How many alternatives the sequence wants at these positions."""
        params = self.seq.params
        return (params.logprobs if self.forced else params.prompt_logprobs) or 0

    @property
    def temperature(self) -> float:
        """The temperature of the distribution its logprobs report: 1 (the model's own), but for
        the forced tokens of an SMC particle, weighed at its sampling temperature."""
        params = self.seq.params
        return params.temperature if self.forced and params.smc is not None else 1.0


@dataclass(frozen=True, slots=True)
class InFlightTokens:
    """The sampled tokens of a step still in flight (the engine's lookahead): `tokens` [B] int64 on
    the device, and the row of each sequence that samples one there (by seq_id). A sequence whose
    next input is such a token holds `PENDING_TOKEN` in its place; the input takes the value on the
    device, without reading it back."""

    tokens: torch.Tensor  # [B] int64
    rows: dict[int, int]


@dataclass(frozen=True, slots=True)
class ModelInput:
    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    attn: AttentionMetadata
    logits_indices: torch.Tensor  # [S] int64, the last known token of each sampling sequence (and its drafts)
    known_rows: torch.Tensor | None  # [N] int64 step rows whose next token is known and wants logprobs
    known_targets: torch.Tensor | None  # [N] int64 those next (actual) tokens
    known_spans: list[KnownSpan]
    rows: StepRows  # which rows may multiply through the BLAS GEMM: the prompt rows


@dataclass(frozen=True, slots=True)
class StepPlan:
    """A step's inputs as host values: what rank 0 hands the other tensor-parallel ranks."""

    input_ids: list[int]  # [T]
    query_lens: list[int]  # [B]
    context_lens: list[int]  # [B]
    block_tables: np.ndarray  # [B, max_blocks] int64
    logits_indices: list[int]  # [S]
    known_rows: list[int]  # [N]
    known_targets: list[int]  # [N]
    pending: list[int]  # [2P]: (input row, its row in the step in flight) pairs
    block_copies: list[tuple[int, int]]  # copy-on-write: (source block, destination block)
    # Rows whose new tokens all follow the prompt (decode, forced and drafted tokens): they attend
    # token by token however many they are, so that each token gets the numbers decoding gives it
    # alone (speculation and fast-forward change how many a row holds, never their values).
    generated_rows: list[int]
    # (first, end) step rows of each sequence's prompt tokens, where it has some: every other row
    # holds a generated token and multiplies through the panels (`StepRows`)
    prompt_token_rows: list[tuple[int, int]]
    # the sliding-window layers' pool, where the model has one (`CacheConfig.num_window_blocks`)
    window_tables: np.ndarray | None = None  # [B, max_blocks] int64
    window_copies: list[tuple[int, int]] | None = None


@dataclass(frozen=True, slots=True)
class StepLogits:
    logits: torch.Tensor  # [S, V] float32, the sampling rows
    known_hidden: torch.Tensor | None  # [N, hidden] for the known tokens' logprobs (see ModelInput)
    known_targets: torch.Tensor | None  # [N] int64
    known_spans: list[KnownSpan]


class ModelRunner:
    def __init__(
        self,
        model: LlamaForCausalLM,
        model_config: ModelConfig,
        cache_config: CacheConfig,
        device: torch.device,
        dtype: torch.dtype,
    ) -> None:
        self.model = model
        self.device = device
        self.block_size = cache_config.block_size
        self.attention = model.attention  # the backend: the cache layout and the step's metadata
        # the cache's dtype: the activations', or half precision or Q8_0 beside float32 ones
        # (`kv_cache_dtype`)
        self.kv_dtype = cache_config.dtype or dtype
        heads, head_dim = model_config.num_kv_heads, model_config.head_dim
        shape = self.attention.kv_cache_shape(
            cache_config.num_blocks, cache_config.block_size, heads, head_dim, self.kv_dtype
        )
        # One block more than the pool: the scratch block, never given to a sequence, where the
        # padding rows of a replayed decode graph write. Zero-filled: slots never written are masked
        # out, but 0 * garbage could still be NaN.
        self.scratch_block = cache_config.num_blocks
        # Sliding-window layers keep their blocks in a pool of their own where the cache config has
        # one (`weft/engine/window_blocks.py`); its scratch block too is one past its pool.
        num_window = cache_config.num_window_blocks
        self.window_scratch = num_window if num_window else None
        layers = range(model_config.num_layers)
        self.in_window_pool = [bool(num_window and model_config.layer_window(i)) for i in layers]
        sizes = [(num_window if w else cache_config.num_blocks) + 1 for w in self.in_window_pool]
        self.kv_caches: list[KVCache] = [zeros((n, *shape[1:]), self.kv_dtype, device) for n in sizes]
        self.graphs: DecodeGraphs | None = None  # decode steps replayed as CUDA graphs (`capture_graphs`)
        self.tp = model.tp  # tensor parallel: the group whose other ranks follow each step
        # whether a step's generated rows need an index (`StepRows`): some matrix may take the GEMM
        self.takes_gemm = any(m.takes_gemm for m in model.modules() if isinstance(m, Linear))
        # CUDA: a step's inputs go to the device in one copy from one pinned buffer
        self.uploads = StepUploads(device) if device.type == "cuda" else None

    @property
    def kv_bytes_per_token(self) -> int:
        """What one more token's keys and values take in this rank's cache: in every layer, but
        for the sliding-window layers of a window pool, which hold at most a window's."""
        return self.kv_block_bytes[0] // self.block_size

    @property
    def kv_block_bytes(self) -> tuple[int, int]:
        """(a main-pool block's bytes over its layers, a window-pool block's over its layers)."""
        sizes = [0, 0]
        for cache, in_window in zip(self.kv_caches, self.in_window_pool, strict=True):
            sizes[in_window] += cache[0].numel() * cache.element_size()
        return sizes[0], sizes[1]

    @staticmethod
    def kv_bytes_per_block(model_config: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
        shape = PagedAttention.kv_cache_shape(
            1, block_size, model_config.num_kv_heads, model_config.head_dim, dtype
        )  # fmt: skip
        return math.prod(shape) * model_config.num_layers * torch.tensor([], dtype=dtype).element_size()

    def prepare(self, sched: SchedulerOutput, in_flight: InFlightTokens | None = None) -> ModelInput:
        plan, spans = self.plan(sched, in_flight)
        return self.inputs(plan, spans, in_flight)

    def plan(
        self, sched: SchedulerOutput, in_flight: InFlightTokens | None = None
    ) -> tuple[StepPlan, list[KnownSpan]]:
        """The step's inputs as host values (what every tensor-parallel rank needs), and the spans
        of the rows whose next token's logprobs are wanted."""
        rows = _StepRowsPlan()
        for item in sched.scheduled:
            rows.add(item, in_flight)
        tables = sched.block_tables.gather([s.table.row for s in sched.scheduled])  # [B, max_blocks]
        window_tables = None
        if sched.window_tables is not None:  # [B, max_blocks]
            window_tables = sched.window_tables.gather([s.table.window_row for s in sched.scheduled])
        plan = StepPlan(
            rows.input_ids, rows.query_lens, rows.context_lens, tables, rows.logits_indices,
            rows.known_rows, rows.known_targets, rows.pending, sched.block_copies,
            rows.generated_rows, rows.prompt_token_rows, window_tables, sched.window_copies,
        )  # fmt: skip
        return plan, rows.spans

    def inputs(
        self, plan: StepPlan, spans: list[KnownSpan], in_flight: InFlightTokens | None = None
    ) -> ModelInput:
        """The step's inputs as device tensors (on CUDA all of them in one copy, `StepUploads`)."""
        uploads = self.uploads
        put = uploads.begin() if uploads is not None else self._put
        attn, positions = self.attention.build_metadata(
            plan.query_lens, plan.context_lens, plan.block_tables, self.block_size, self.device,
            plan.generated_rows, put, plan.window_tables,
        )  # fmt: skip
        ids = put(np.array(plan.input_ids, dtype=np.int64))
        where = put(np.array(plan.pending, dtype=np.int64)) if plan.pending else None
        known_rows = plan.known_rows
        step_input = ModelInput(
            input_ids=ids,
            positions=positions,
            attn=attn,
            logits_indices=put(np.array(plan.logits_indices, dtype=np.int64)),
            known_rows=put(np.array(known_rows, dtype=np.int64)) if known_rows else None,
            known_targets=put(np.array(plan.known_targets, dtype=np.int64)) if known_rows else None,
            known_spans=spans,
            rows=self._step_rows(plan.prompt_token_rows, len(plan.input_ids), put),
        )
        if uploads is not None:
            uploads.send()  # before any device work reads an input
        if where is not None:  # the tokens the step in flight samples, taken on the device
            assert in_flight is not None
            pairs = where.view(-1, 2)  # [P, 2]
            ids[pairs[:, 0]] = in_flight.tokens[pairs[:, 1]]
        return step_input

    def _put(self, array: np.ndarray) -> torch.Tensor:
        return to_device(array, self.device)

    def _step_rows(self, prompt_token_rows: list[tuple[int, int]], num_rows: int, put: Upload) -> StepRows:
        """The step's prompt rows, and where it also holds generated ones and some matrix may take
        the GEMM, their index (built for those steps alone: a few microseconds a step)."""
        num_prompt = sum(end - first for first, end in prompt_token_rows)
        if num_prompt in (0, num_rows) or not self.takes_gemm:  # no index to keep
            return StepRows(num_prompt)
        generated = np.ones(num_rows, dtype=bool)  # [T]
        for first, end in prompt_token_rows:
            generated[first:end] = False
        return StepRows(num_prompt, put(np.flatnonzero(generated)))

    @torch.inference_mode()
    def execute(self, sched: SchedulerOutput, in_flight: InFlightTokens | None = None) -> StepLogits:
        """Run one step: logits [S, V] float32 for the sampling sequences, in order, and the hidden
        states of the rows whose prompt logprobs are wanted (their logits are computed in chunks).
        `in_flight`: the step still running whose sampled tokens some inputs are. With tensor
        parallelism the plan goes to the other ranks first, which run the same step (`follow`)."""
        plan, spans = self.plan(sched, in_flight)
        if self.tp is not None:
            self.tp.send(plan)
        self.copy_blocks(plan.block_copies, plan.window_copies)
        inputs = self.inputs(plan, spans, in_flight)
        hidden = self._forward(inputs)  # [T, hidden]
        logits = self.model.compute_logits(hidden[inputs.logits_indices], GENERATED_ROWS)
        known_hidden = None if inputs.known_rows is None else hidden[inputs.known_rows]
        return StepLogits(logits, known_hidden, inputs.known_targets, inputs.known_spans)

    @torch.inference_mode()
    def follow(self, plan: StepPlan) -> None:
        """Another tensor-parallel rank: run the step rank 0 planned, taking part in every collective
        rank 0's `execute` and its prompt logprobs make, in the same order."""
        self.copy_blocks(plan.block_copies, plan.window_copies)
        inputs = self.inputs(plan, [])
        hidden = self._forward(inputs)  # [T, hidden]
        self.model.compute_logits(hidden[inputs.logits_indices], GENERATED_ROWS)
        if inputs.known_rows is not None:  # as `prompt_logprobs` computes them on rank 0, in chunks
            known_hidden = hidden[inputs.known_rows]
            for start in range(0, known_hidden.shape[0], PROMPT_CHUNK_ROWS):
                self.model.compute_logits(known_hidden[start : start + PROMPT_CHUNK_ROWS])

    def _forward(self, inputs: ModelInput) -> torch.Tensor:  # [T, hidden]
        """A replayed decode graph where one fits the step, else the eager forward."""
        if self.graphs is not None:
            hidden = self.graphs.run(inputs.input_ids, inputs.positions, inputs.attn)
            if hidden is not None:
                return hidden
        return self.model(inputs.input_ids, inputs.positions, self.kv_caches, inputs.attn, inputs.rows)

    @torch.inference_mode()
    def capture_graphs(
        self, max_model_len: int, max_num_seqs: int, capture: Capture, progress: bool = False
    ) -> CaptureReport | None:
        """Capture decode steps for replay (see `weft/engine/graphs.py`); None, and every step eager,
        when the kernel set cannot read a static block table (no `RaggedBatch`)."""
        if not self.model.kernels.takes_ragged_batch(self.model.config.head_dim, self.block_size):
            return None
        graphs = DecodeGraphs(
            self.model, self.kv_caches, self.scratch_block, self.block_size, max_model_len, max_num_seqs,
            self.window_scratch,
        )  # fmt: skip
        pool = torch.cuda.graph_pool_handle() if self.device.type == "cuda" else None
        report = graphs.capture(capture, pool, progress)
        self.graphs = graphs
        return report

    def copy_blocks(
        self, copies: list[tuple[int, int]], window_copies: list[tuple[int, int]] | None = None
    ) -> None:
        """Copy-on-write: duplicate shared blocks before a sequence writes into its private copy
        (`window_copies`: those of the sliding-window layers' pool)."""
        for pairs, windowed in ((copies, False), (window_copies, True)):
            if not pairs:
                continue
            src = column([s for s, _ in pairs], np.int64, self.device)  # (pinned, non-blocking on CUDA)
            dst = column([d for _, d in pairs], np.int64, self.device)
            for kv_cache, in_window in zip(self.kv_caches, self.in_window_pool, strict=True):
                if in_window == windowed:
                    kv_cache[dst] = kv_cache[src]


def zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A zero-filled tensor; on CPU in anonymous memory, whose pages the operating system zeroes as
    they are first touched: a KV cache of gigabytes costs nothing at load (torch.zeros writes every
    byte: 2.6 s for 2 GiB on a 2-core machine), and only the blocks sequences use are ever paged in."""
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    size = math.prod(shape) * torch.tensor([], dtype=dtype).element_size()
    if size == 0:
        return torch.zeros(shape, dtype=dtype)
    return torch.frombuffer(mmap.mmap(-1, size), dtype=torch.uint8).view(dtype).view(shape)


@dataclass(slots=True)
class _StepRowsPlan:
    """A step's rows as `ModelRunner.plan` lays them out, a scheduled sequence at a time."""

    input_ids: list[int] = field(default_factory=list)  # [T]
    pending: list[int] = field(default_factory=list)  # (input row, its row in the step in flight) pairs
    query_lens: list[int] = field(default_factory=list)  # [B]
    context_lens: list[int] = field(default_factory=list)  # [B]
    logits_indices: list[int] = field(default_factory=list)  # [S]
    known_rows: list[int] = field(default_factory=list)  # [N]
    known_targets: list[int] = field(default_factory=list)  # [N]
    spans: list[KnownSpan] = field(default_factory=list)
    generated_rows: list[int] = field(default_factory=list)
    prompt_token_rows: list[tuple[int, int]] = field(default_factory=list)

    def add(self, item: ScheduledSequence, in_flight: InFlightTokens | None) -> None:
        """`item`'s input rows: its new known tokens, then its drafts; logits at its last known
        token and after each draft with a row (`ScheduledSequence.row_depths`)."""
        seq, num_new, drafts, input_ids = item.seq, item.num_new_tokens, item.drafts, self.input_ids
        start, num_prompt, first = seq.num_computed_tokens, len(seq.prompt_token_ids), len(input_ids)
        if start < num_prompt:  # (its drafts come after its last known token, so after any prompt token)
            self.prompt_token_rows.append((first, first + min(num_new, num_prompt - start)))
        elif num_new > 1:
            self.generated_rows.append(len(self.query_lens))
        if seq.needs_prompt_logprobs or seq.num_pending_forced:
            self.spans += _known_token_spans(seq, start, num_new, first, self.known_rows, self.known_targets)
        if num_new == 1:
            input_ids.append(seq.token_ids[start])
        elif not drafts:
            input_ids.extend(seq.token_ids[start : start + num_new])
        else:  # its last known tokens, then its drafts
            input_ids.extend(seq.token_ids[start:])
            input_ids.extend(drafts)
        if seq.num_pending and start + num_new == len(seq.token_ids):
            assert in_flight is not None, "a pending token without the step that samples it"
            self.pending += (len(input_ids) - 1, in_flight.rows[seq.seq_id])
        self.query_lens.append(num_new)
        self.context_lens.append(start + num_new)
        if drafts:
            last_known = len(input_ids) - 1 - len(drafts)
            self.logits_indices.extend(last_known + depth for depth in item.row_depths)
        elif item.samples:
            self.logits_indices.append(len(input_ids) - 1)


def _known_token_spans(
    seq: Sequence, start: int, num_new: int, first_row: int, rows: list[int], targets: list[int]
) -> list[KnownSpan]:
    """The spans of this step's rows whose next token is known and still lacks its logprob: a
    prompt token (`prompt_logprobs`), or a token a grammar forced (`num_pending_forced`). The row
    of position p predicts token p + 1; this step computes positions start .. start + num_new - 1."""
    spans = []
    wanted = []  # (first token, last token inclusive, forced)
    if seq.prompt_logprobs is not None:
        wanted.append((len(seq.prompt_logprobs), seq.num_prompt_tokens - 1, False))
    if seq.num_pending_forced:
        wanted.append((seq.num_tokens - seq.num_pending_forced, seq.num_tokens - 1, True))
    for first_wanted, last_wanted, forced in wanted:
        first_token = max(start + 1, first_wanted)
        last_token = min(start + num_new, last_wanted)
        if last_token < first_token:
            continue
        rows.extend(range(first_row + first_token - 1 - start, first_row + last_token - start))
        targets.extend(seq.token_ids[first_token : last_token + 1])
        spans.append(KnownSpan(seq, first_token, last_token - first_token + 1, forced))
    return spans
