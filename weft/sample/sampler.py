"""The batch sampler: one vectorized pass over all rows, each with its own parameters."""

from __future__ import annotations

import operator
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Protocol

import numpy as np
import torch

from weft import ops
from weft.arrays import column, padded, to_device
from weft.kernels import TORCH_KERNELS, TorchKernels
from weft.outputs import LogprobsTensors, SamplerOutput
from weft.params import LogitsProcessor, LogprobsMode, SamplingParams

# The token id reported for a row whose logits were not finite (a NaN, or every token at -inf).
INVALID_TOKEN = -1


class SamplingRow(Protocol):
    """What the sampler reads of the sequence behind one logits row."""

    @property
    def params(self) -> SamplingParams: ...
    @property
    def seed(self) -> int: ...
    @property
    def num_tokens(self) -> int: ...
    @property
    def num_output_tokens(self) -> int: ...
    @property
    def prompt_token_ids(self) -> list[int]: ...
    @property
    def output_token_ids(self) -> list[int]: ...
    @property
    def eos_token_ids(self) -> frozenset[int]: ...


class LogitsMask(Protocol):
    """A mask that some rows' constraint (a grammar) puts on the logits."""

    def apply(self, logits: torch.Tensor) -> None:
        """Set disallowed logits ([B, V] float32) to -inf, in place."""
        ...


@dataclass(frozen=True, slots=True)
class Penalties:
    prompt_ids: torch.Tensor  # [B, Lp] int64, padded with V
    output_ids: torch.Tensor  # [B, Lo] int64, padded with V
    repetition: torch.Tensor  # [B] float32
    presence: torch.Tensor  # [B] float32
    frequency: torch.Tensor  # [B] float32


@dataclass(frozen=True, slots=True)
class SamplingColumns:
    """The per-row sampling parameters of a batch as tensors, with flags for the fast paths: what
    stays the same while the same sequences run in the same order."""

    temperature: torch.Tensor  # [B] float32, 1 for greedy rows (they take the argmax)
    is_greedy: torch.Tensor  # [B] bool
    top_k: torch.Tensor | None  # [B] int64, 0 = off; None when no row uses it
    max_top_k: int  # the largest effective k over the rows (the vocabulary for rows without top-k)
    top_p: torch.Tensor | None  # [B] float32; None when no row uses it
    min_p: torch.Tensor | None  # [B] float32; None when no row uses it
    seeds: torch.Tensor  # [B] int64
    all_greedy: bool
    scales: bool  # some sampled row has a temperature other than 1
    num_top_logprobs: int | None  # max top-n over rows; None when no row wants logprobs
    logprob_rows: tuple[int, ...]  # [R] the rows that want logprobs (the others pay nothing for them)
    logprob_index: torch.Tensor | None  # [R] int64 of those rows; None when R == B
    processed_rows: torch.Tensor | None  # [R] bool, which of them want PROCESSED logprobs
    masked_rows: torch.Tensor | None  # [R] bool, which of them want MASKED logprobs
    # [R] float32, the temperature of each logprob row's reported distribution: an SMC particle's
    # (its weights use that distribution), 1 for the others; None when every row's is 1
    logprob_temperature: torch.Tensor | None

    @classmethod
    def build(
        cls, params: Sequence[SamplingParams], seeds: list[int], vocab_size: int, device: torch.device
    ) -> SamplingColumns:
        greedy = [p.is_greedy for p in params]

        def column(values: Sequence[float], dtype: torch.dtype) -> torch.Tensor:
            return _column(values, dtype, device)

        top_k = [p.top_k for p in params]
        top_p = [p.top_p for p in params]
        min_p = [p.min_p for p in params]
        wanted = [p.logprobs for p in params if p.logprobs is not None]
        logprob_rows = tuple(i for i, p in enumerate(params) if p.logprobs is not None)
        processed = [p.logprobs is not None and p.logprobs_mode == LogprobsMode.PROCESSED for p in params]
        masked = [p.logprobs is not None and p.logprobs_mode == LogprobsMode.MASKED for p in params]
        tempered = [params[i].temperature if params[i].smc is not None else 1.0 for i in logprob_rows]
        return cls(
            temperature=column([1.0 if p.is_greedy else p.temperature for p in params], torch.float32),
            is_greedy=column(greedy, torch.bool),
            top_k=column(top_k, torch.int64) if any(k > 0 for k in top_k) else None,
            max_top_k=min(vocab_size, max(k if k > 0 else vocab_size for k in top_k)) if top_k else 0,
            top_p=column(top_p, torch.float32) if any(p < 1.0 for p in top_p) else None,
            min_p=column(min_p, torch.float32) if any(p > 0.0 for p in min_p) else None,
            seeds=column(seeds, torch.int64),
            all_greedy=all(greedy),
            scales=any(not p.is_greedy and p.temperature != 1.0 for p in params),
            num_top_logprobs=max(wanted) if wanted else None,
            logprob_rows=logprob_rows,
            logprob_index=column(logprob_rows, torch.int64) if 0 < len(logprob_rows) < len(params) else None,
            processed_rows=column([processed[i] for i in logprob_rows], torch.bool)
            if any(processed)
            else None,
            masked_rows=column([masked[i] for i in logprob_rows], torch.bool) if any(masked) else None,
            logprob_temperature=column(tempered, torch.float32) if any(t != 1.0 for t in tempered) else None,
        )


@dataclass(frozen=True, slots=True)
class SamplingBatch:
    """One step's sampling parameters: the per-row columns and what changes every step."""

    columns: SamplingColumns
    positions: torch.Tensor  # [B] int64, index of the token being sampled
    penalties: Penalties | None
    banned: tuple[torch.Tensor, torch.Tensor] | None  # (row idx, token id) [N] int64 each: min_tokens
    processors: list[tuple[int, Sequence[LogitsProcessor], list[int]]]  # (row, fns, output token ids)

    @classmethod
    def build(
        cls,
        requests: Sequence[SamplingRow],
        vocab_size: int,
        device: torch.device,
        static: StaticColumns | None = None,
    ) -> SamplingBatch:
        """This step's batch; `static` (from `SamplingBatchBuilder`) saves rebuilding the columns
        that do not change while the same sequences run."""
        static = static or StaticColumns.build(requests, vocab_size, device)
        return cls(
            columns=static.columns,
            positions=_column([r.num_tokens for r in requests], torch.int64, device),
            penalties=_penalties(requests, static, vocab_size, device),
            banned=_banned_until_min_tokens(requests, static.min_tokens_rows, device),
            processors=[
                (i, requests[i].params.logits_processors, requests[i].output_token_ids)
                for i in static.processor_rows
            ],
        )


@dataclass(frozen=True, slots=True)
class StaticColumns:
    """What a batch keeps while the same sequences run in the same order (the steady decoding
    state): the columns, and what the per-step parts are built from."""

    columns: SamplingColumns
    min_tokens_rows: tuple[int, ...]  # the rows with a min_tokens (EOS and stop tokens banned below it)
    processor_rows: tuple[int, ...]  # the rows with logits processors
    prompt_ids: torch.Tensor | None  # [B, Lp] int64 padded with V, for the penalties; None if unused
    penalty_scales: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None  # repetition, presence, frequency

    @classmethod
    def build(cls, requests: Sequence[SamplingRow], vocab_size: int, device: torch.device) -> StaticColumns:
        params = [r.params for r in requests]
        columns = SamplingColumns.build(params, [r.seed for r in requests], vocab_size, device)
        min_tokens_rows = tuple(i for i, p in enumerate(params) if p.min_tokens > 0)
        processor_rows = tuple(i for i, p in enumerate(params) if p.logits_processors)
        return cls(columns, min_tokens_rows, processor_rows, *_penalty_statics(requests, vocab_size, device))


def _penalty_statics(
    requests: Sequence[SamplingRow], vocab_size: int, device: torch.device
) -> tuple[torch.Tensor | None, tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None]:
    active = [r.params.needs_penalties for r in requests]
    if not any(active):
        return None, None
    prompt = _pad(
        [r.prompt_token_ids if a else [] for r, a in zip(requests, active, strict=True)], vocab_size, device
    )
    repetition, presence, frequency = (
        _column([getattr(r.params, name) for r in requests], torch.float32, device)
        for name in ("repetition_penalty", "presence_penalty", "frequency_penalty")
    )
    return prompt, (repetition, presence, frequency)


class SamplingBatchBuilder:
    """Builds each step's `SamplingBatch`, rebuilding the static columns only when the rows change
    (a sequence joins, leaves or moves): in the steady decoding state only the positions and the
    per-token parts (penalty counts, min_tokens bans) are new. Rows are compared by identity: a
    row's params and seed never change (a `Sequence`'s are fixed when it is created)."""

    def __init__(self) -> None:
        self._rows: list[SamplingRow] = []
        self._static: StaticColumns | None = None

    def build(self, requests: Sequence[SamplingRow], vocab_size: int, device: torch.device) -> SamplingBatch:
        same = (
            self._static is not None
            and len(requests) == len(self._rows)
            and all(map(operator.is_, requests, self._rows))
        )
        if not same:
            self._static = StaticColumns.build(requests, vocab_size, device)
            self._rows = list(requests)
        return SamplingBatch.build(requests, vocab_size, device, self._static)


_NUMPY = {torch.float32: np.float32, torch.int64: np.int64, torch.bool: np.bool_}


def _column(values: Sequence[float], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    return column(values, _NUMPY[dtype], device)


def _pad(rows: list[list[int]], pad: int, device: torch.device) -> torch.Tensor:
    return to_device(padded(rows, pad, min_width=1), device)  # [B, longest] int64


def _penalties(
    requests: Sequence[SamplingRow], static: StaticColumns, vocab_size: int, device: torch.device
) -> Penalties | None:
    if static.prompt_ids is None or static.penalty_scales is None:
        return None
    active = [r.params.needs_penalties for r in requests]
    repetition, presence, frequency = static.penalty_scales
    return Penalties(
        prompt_ids=static.prompt_ids,
        output_ids=_pad(
            [r.output_token_ids if a else [] for r, a in zip(requests, active, strict=True)],
            vocab_size,
            device,
        ),
        repetition=repetition,
        presence=presence,
        frequency=frequency,
    )


def _banned_until_min_tokens(
    requests: Sequence[SamplingRow], candidates: Sequence[int], device: torch.device
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """EOS and stop tokens may not end a request before it has `min_tokens` output tokens
    (`candidates`: the rows with a min_tokens)."""
    rows: list[int] = []
    tokens: list[int] = []
    for i in candidates:
        r = requests[i]
        if r.num_output_tokens < r.params.min_tokens:
            stop_ids = set(r.params.stop_token_ids) | (set() if r.params.ignore_eos else r.eos_token_ids)
            rows.extend([i] * len(stop_ids))
            tokens.extend(stop_ids)
    if not rows:
        return None
    return _column(rows, torch.int64, device), _column(tokens, torch.int64, device)


class Sampler:
    """Steps, in order:
    1. padding: ids past the tokenizer's vocabulary (rows of a padded embedding) are never sampled;
    2. keep the raw logits of the rows that ask for logprobs (the model's own distribution; a copy
       only when a later step changes the logits in place; an SMC particle's at its temperature);
    3. the grammar mask of the constrained rows (`LogitsMask`, filled while the forward ran), and for
       the rows that want logprobs the model's log-probability mass on the tokens it allowed;
    4. ban EOS/stop tokens for rows below `min_tokens`;
    5. third-party logits processors, on the rows that have them;
    6. repetition, presence and frequency penalties;
    7. temperature;
    8. top-k, then top-p, then min-p filtering;
    9. sample: argmax for greedy rows, Gumbel-max keyed by (seed, position) for the others; a row
       whose logits are not finite (a NaN, or nothing left above -inf) gets `INVALID_TOKEN`, found
       from the row maxima that the argmax computes anyway;
    10. the sampled token's logprob and rank, and the top-n alternatives (`row_logprobs`: one pass
        over each row that asked, its log-softmax never written out).
    """

    def __init__(self, num_real_tokens: int | None = None, kernels: TorchKernels = TORCH_KERNELS) -> None:
        self.num_real_tokens = num_real_tokens  # the tokenizer's vocabulary; None = every logit
        self.kernels = kernels  # the device's: logprob ranks and top-n

    def __call__(
        self, logits: torch.Tensor, batch: SamplingBatch, mask: LogitsMask | None = None
    ) -> SamplerOutput:
        """logits: [B, V] float32, modified in place."""
        if self.num_real_tokens is not None and self.num_real_tokens < logits.shape[-1]:
            logits[:, self.num_real_tokens :] = float("-inf")
        raw = self._raw_logits(logits, batch, mask)  # [R, V]: only the rows that want logprobs
        if raw is not None and batch.columns.logprob_temperature is not None:
            raw = raw / batch.columns.logprob_temperature[:, None]  # SMC particles: at their temperature
        logmass = None  # [R]: the model's log-probability mass on what the grammar allowed
        if mask is not None:
            mask.apply(logits)
            if raw is not None:
                logmass = self.kernels.constraint_logmass(raw, logits, batch.columns.logprob_index)
        if batch.banned is not None:
            logits[batch.banned] = float("-inf")
        errors = self._run_processors(logits, batch)
        if batch.penalties is not None:
            p = batch.penalties
            ops.apply_penalties(logits, p.prompt_ids, p.output_ids, p.repetition, p.presence, p.frequency)
        if batch.columns.scales:
            logits = logits / batch.columns.temperature[:, None]
        logits = self._filter(logits, batch)
        token_ids = self._sample(logits, batch)
        out = self._gather(logits, raw, token_ids, batch, logmass)
        return replace(out, errors=errors) if errors else out

    @staticmethod
    def _raw_logits(
        logits: torch.Tensor, batch: SamplingBatch, mask: LogitsMask | None
    ) -> torch.Tensor | None:
        """[R, V] the logits of the rows that want logprobs as the model gave them, or None. The
        steps that change logits in place (mask, banned tokens, processors, penalties) get a copy."""
        if batch.columns.num_top_logprobs is None:
            return None
        if batch.columns.logprob_index is not None:
            return logits.index_select(0, batch.columns.logprob_index)  # a copy already
        in_place = (
            mask is not None or batch.banned is not None or batch.processors or batch.penalties is not None
        )
        return logits.clone() if in_place else logits

    def _run_processors(self, logits: torch.Tensor, batch: SamplingBatch) -> dict[int, str]:
        """Third-party processors, row by row (they are Python callables). One that raises or returns
        a wrong shape fails its own row, which the engine finishes with an error; the batch goes on."""
        errors: dict[int, str] = {}
        for row, fns, token_ids in batch.processors:
            try:
                for fn in fns:
                    result = fn(list(token_ids), logits[row])
                    if not isinstance(result, torch.Tensor) or result.shape != logits[row].shape:
                        raise TypeError(
                            f"returned {type(result).__name__} instead of a tensor of shape "
                            f"{tuple(logits[row].shape)}"
                        )
                    logits[row] = result
            except Exception as exc:
                errors[row] = f"logits processor {getattr(fn, '__name__', fn)!r} failed: {exc}"
                logits[row] = 0.0  # sample something harmless; the row is finished with an error
        return errors

    def _filter(self, logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        if batch.columns.top_k is not None:
            logits = ops.apply_top_k(logits, batch.columns.top_k, batch.columns.max_top_k)
        if batch.columns.top_p is not None:
            logits = self.kernels.top_p_filter(logits, batch.columns.top_p)
        if batch.columns.min_p is not None:
            logits = ops.apply_min_p(logits, batch.columns.min_p)
        return logits

    def _sample(self, logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        """[B, V] -> [B] int64, `INVALID_TOKEN` on rows that are not finite."""
        if batch.columns.all_greedy:
            return self.kernels.greedy_tokens(logits, INVALID_TOKEN)
        maxima, greedy = self.kernels.row_max(logits)  # [B] each; a NaN row's maximum is NaN
        invalid = maxima.isnan() | (maxima == float("-inf"))  # [B] bool
        sampled = self.kernels.gumbel_argmax(logits, batch.columns.seeds, batch.positions)
        chosen = torch.where(batch.columns.is_greedy, greedy, sampled)
        return chosen.masked_fill(invalid, INVALID_TOKEN)

    def _gather(
        self,
        logits: torch.Tensor,
        raw: torch.Tensor | None,
        token_ids: torch.Tensor,
        batch: SamplingBatch,
        logmass: torch.Tensor | None = None,
    ) -> SamplerOutput:
        if batch.columns.num_top_logprobs is None or raw is None:
            return SamplerOutput(token_ids=token_ids, logprobs=None, top_logprobs=None)
        valid_ids = _rows(token_ids, batch.columns.logprob_index).clamp(min=0)  # an invalid row is never read
        source, norm = raw, None  # [R, V] and [R]: logprobs are source - norm (None: its log-softmax)
        if batch.columns.processed_rows is not None or batch.columns.masked_rows is not None:
            source, norm = self._mixed_modes(logits, raw, batch)
        ids, values, ranks = self.kernels.row_logprobs(
            source, valid_ids, batch.columns.num_top_logprobs, norm
        )
        return SamplerOutput(
            token_ids=token_ids,
            logprobs=values[:, 0],
            top_logprobs=LogprobsTensors(
                token_ids=ids,
                logprobs=values,
                ranks=ranks,
                rows=batch.columns.logprob_rows,
                constraint_logmass=logmass,
            ),
        )

    @staticmethod
    def _mixed_modes(
        logits: torch.Tensor, raw: torch.Tensor, batch: SamplingBatch
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Per row, the logits whose logprobs are reported and their log-normalizer: raw rows the
        model's own (NaN: the kernel's own log-softmax, so that a raw row's numbers do not depend
        on whether other rows mix); PROCESSED rows the distribution sampled from (after every step
        above); MASKED rows the raw logprobs with -inf for the tokens that could not be sampled (not
        renormalized)."""
        final = _rows(logits, batch.columns.logprob_index)  # [R, V]
        source, norm = raw, raw.new_full(raw.shape[:1], float("nan"))  # [R, V], [R]
        if batch.columns.processed_rows is not None:
            processed = batch.columns.processed_rows
            source = torch.where(processed[:, None], final, source)
            norm = torch.where(processed, torch.logsumexp(final, dim=-1), norm)
        if batch.columns.masked_rows is not None:
            masked_rows = batch.columns.masked_rows
            masked = raw.masked_fill(final == float("-inf"), float("-inf"))
            source = torch.where(masked_rows[:, None], masked, source)
            norm = torch.where(masked_rows, torch.logsumexp(raw, dim=-1), norm)
        return source, norm


def _rows(x: torch.Tensor, index: torch.Tensor | None) -> torch.Tensor:
    """The rows `index` of `x` ([B, ...]), or all of them."""
    return x if index is None else x.index_select(0, index)
