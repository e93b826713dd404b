"""One user request: its prompt, its parameters, its sequences and the policy that runs them.

A policy decides, after each step, which sequences to fork and which to prune, and which sequences
the request's output reports. The engine applies its decisions (`GroupUpdate`) through the
scheduler, and asks the policy what it allows (`validate`, `allows_lookahead`); neither the
scheduler nor the sampler knows about policies. Parallel sampling (`n`, `best_of`) is here; beam
search (`weft.engine.beam`) and exact choice (`weft.engine.exact_choice`) are the others.
"""

from __future__ import annotations

import itertools
import random
from dataclasses import dataclass, field
from typing import Protocol

from weft.engine.sequence import FinishReason, Sequence
from weft.outputs import CompletionOutput, PositionLogprobs, RequestOutput, SpeculationCounts
from weft.params import OutputKind, SamplingParams


class Spawner:
    """Hands out sequence ids and seeds: the one place that numbers sequences."""

    def __init__(self, seed: int) -> None:
        self._ids = itertools.count()
        self._seeds = random.Random(seed)

    def next_id(self) -> int:
        return next(self._ids)

    def seed_for(self, params: SamplingParams, index: int) -> int:
        """Sample `index` of a seeded request uses `seed + index`; an unseeded one draws a seed."""
        return self._seeds.getrandbits(62) if params.seed is None else params.seed + index

    def rng_for(self, params: SamplingParams) -> random.Random:
        """A request's own random draws (beyond its sequences' noise): from its seed when it has
        one, so that a seeded request reproduces."""
        return random.Random(params.seed if params.seed is not None else self._seeds.getrandbits(62))

    def fork(self, parent: Sequence, index: int) -> Sequence:
        return parent.fork(self.next_id(), index, self.seed_for(parent.params, index))


@dataclass(frozen=True, slots=True)
class GroupUpdate:
    """A policy's decisions after a step."""

    forks: list[tuple[Sequence, Sequence]] = field(default_factory=list)  # (parent, child) to schedule
    prunes: list[Sequence] = field(default_factory=list)  # to release (the policy keeps the group's list)
    resumes: list[Sequence] = field(default_factory=list)  # parked sequences given a token: run again


_FINAL_ONLY = OutputKind.FINAL_ONLY  # a module constant: an Enum member lookup costs ~0.2 us per row

NO_UPDATE = GroupUpdate()  # what most groups decide after most steps; read, never modified


class GroupPolicy(Protocol):
    def validate(self, params: SamplingParams, vocab_size: int, max_logprobs: int) -> None:
        """Raise ValueError, naming the problem, for parameters this policy cannot serve."""
        ...

    def start(self, group: SequenceGroup, first: Sequence, spawner: Spawner) -> None:
        """The group's first sequence is ready (its grammar compiled, or failed); create the rest."""
        ...

    def after_step(self, group: SequenceGroup) -> GroupUpdate: ...

    def reported(self, group: SequenceGroup, finished: bool) -> list[Sequence] | None:
        """The sequences the request's output reports now, in order; None to report nothing yet."""
        ...

    def take_fanout(self, seq: Sequence, limit: int) -> list[Sequence]:
        """Up to `limit` sequences to sample from `seq`'s logits row in the step that computes its
        prompt's last token (they then share its blocks as they are); [] for none."""
        ...

    def allows_lookahead(self) -> bool:
        """Whether the next step may be launched before this step's tokens are on the host: only
        when the policy decides nothing from them (`weft.engine.lookahead`)."""
        ...

    def annotate(self, output: RequestOutput) -> None:
        """Add the policy's own fields to the request's finished output (SMC's weights)."""
        ...


def check_logprob_limits(params: SamplingParams, max_logprobs: int) -> None:
    for name in ("logprobs", "prompt_logprobs"):
        value = getattr(params, name)
        if value is not None and value > max_logprobs:
            raise ValueError(
                f"SamplingParams.{name}={value} is more than this engine's max_logprobs "
                f"({max_logprobs}); ask for fewer, or raise max_logprobs"
            )


@dataclass(slots=True)
class ParallelSampling:
    """`num_samples` independent samples of one prompt. The first computes the prompt; the others
    are forks of it taken before it sampled anything. In the step that computes the prompt's last
    token they draw their own first token from the same logits row (`take_fanout`) and join the
    batch sharing all its blocks; those that find no room under `max_num_seqs` are queued once
    the prompt is computed and recompute its last token for logits of their own.
    With `num_returned` < `num_samples` (best_of), the output reports only at the end, the
    `num_returned` samples of highest cumulative logprob, best first, indexed 0..num_returned-1."""

    num_samples: int
    num_returned: int
    pending: list[Sequence] = field(default_factory=list)
    first: Sequence | None = None  # the one that computes the prompt, which the others fork from

    def validate(self, params: SamplingParams, vocab_size: int, max_logprobs: int) -> None:
        check_logprob_limits(params, max_logprobs)

    def allows_lookahead(self) -> bool:
        return not self.pending  # the other samples wait to fork when the prompt is computed

    def start(self, group: SequenceGroup, first: Sequence, spawner: Spawner) -> None:
        self.first = first
        self.pending = [spawner.fork(first, index) for index in range(1, self.num_samples)]
        group.add(self.pending)

    def take_fanout(self, seq: Sequence, limit: int) -> list[Sequence]:
        """The other samples draw their first token from the first's logits, in the same step."""
        if not self.pending or seq is not self.first:
            return []
        taken, self.pending = self.pending[:limit], self.pending[limit:]
        return taken

    def after_step(self, group: SequenceGroup) -> GroupUpdate:
        if not self.pending:
            return NO_UPDATE
        first = group.sequences[0]
        if not first.is_finished and first.num_computed_tokens < first.num_prompt_tokens:
            return NO_UPDATE
        pending, self.pending = self.pending, []
        if first.finish_reason == FinishReason.ERROR and first.num_output_tokens == 0:
            for child in pending:  # e.g. its grammar is invalid: every sample fails the same way
                child.finish(FinishReason.ERROR, error=first.error)
            return GroupUpdate()
        return GroupUpdate(forks=[(first, child) for child in pending])

    def annotate(self, output: RequestOutput) -> None:
        pass

    def reported(self, group: SequenceGroup, finished: bool) -> list[Sequence] | None:
        if self.num_returned == self.num_samples:
            return group.sequences
        if not finished:
            return None
        best = sorted(group.sequences, key=_ranking)[: self.num_returned]
        for index, seq in enumerate(best):
            seq.index = index
        return best


def _ranking(seq: Sequence) -> tuple[bool, float, int]:
    """Failed samples last, then by cumulative logprob, highest first, then by sample index."""
    failed = seq.error is not None or seq.cumulative_logprob is None
    return failed, -(seq.cumulative_logprob or 0.0), seq.index


@dataclass(slots=True, eq=False)
class SequenceGroup:
    request_id: str  # the user's id, any string
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    policy: GroupPolicy
    sequences: list[Sequence] = field(default_factory=list)  # in output order; pruned ones removed
    prompt_logprobs_sent: bool = False  # DELTA outputs carry the prompt logprobs once

    def add(self, sequences: list[Sequence]) -> None:
        for seq in sequences:
            seq.request_id = self.request_id
        self.sequences.extend(sequences)

    def remove(self, seq: Sequence) -> None:
        if seq in self.sequences:
            self.sequences.remove(seq)

    @property
    def finished(self) -> bool:
        sequences = self.sequences
        if len(sequences) == 1:  # most requests: no generator per step
            return sequences[0].is_finished
        return all(s.is_finished for s in sequences)

    def make_output(
        self, finished: bool, speculation: SpeculationCounts | None = None
    ) -> RequestOutput | None:
        """The request's output now (`finished`: whether every sequence has finished), or None for
        a FINAL_ONLY request that is still running; `speculation`: the drafts of its sequences and
        their accepted tokens (`Speculation.counts`)."""
        kind = self.params.output_kind
        if kind is _FINAL_ONLY and not finished:
            return None
        reported = self.policy.reported(self, finished)
        if reported is None:
            return None
        first = self.sequences[0] if self.sequences else None
        if len(reported) == 1:  # most requests (a comprehension is a function call on 3.11)
            seq = reported[0]
            tracked_only = seq.position_outputs is not None and self.params.logprobs is None
            outputs = [self._completion(seq, kind) if tracked_only else seq.completion(kind)]
        else:
            outputs = [self._completion(s, kind) for s in reported]
        output = RequestOutput(  # positional, as CompletionOutput (once per request per step)
            self.request_id,
            self.prompt,
            self.prompt_token_ids,
            outputs,
            finished,
            first.num_cached_prompt_tokens if first else 0,
            None if first is None or first.prompt_logprobs is None else self._prompt_logprobs(first),
            speculation,
        )
        if finished:
            self.policy.annotate(output)
        return output

    def _completion(self, seq: Sequence, kind: OutputKind) -> CompletionOutput:
        """A sequence's completion; logprobs the engine tracked for itself (best_of ranks by them)
        but the user did not ask for are left out."""
        out = seq.completion(kind)
        if self.params.logprobs is None and out.logprobs is not None:
            out.logprobs = out.constraint_logmass = out.text_offsets = out.forced = None
        return out

    def _prompt_logprobs(self, first: Sequence | None) -> list[PositionLogprobs | None] | None:
        """The prompt logprobs once all are computed (by the first sequence, which computes the
        prompt); a DELTA output carries them once."""
        if first is None or first.prompt_logprobs is None or first.needs_prompt_logprobs:
            return None
        if self.params.output_kind == OutputKind.DELTA:
            if self.prompt_logprobs_sent:
                return None
            self.prompt_logprobs_sent = True
        return first.prompt_logprobs
