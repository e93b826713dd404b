"""A step's layout: what each sequence computes, and which logits row belongs to whom, said once.

The scheduler fills a `SchedulerOutput` (each scheduled sequence's new tokens and blocks); the
engine then lays out its logits rows in a `StepLayout`, and everything after reads that layout
instead of counting rows again: the grammar masks (`grammar_rows`), the sampler's rows
(`Speculation.sampling_rows`), the fanout rows (`fanout_rows`), the scheduler's hand-out of tokens
(`Scheduler.accept`) and the engine's counts (`num_failed`).

The rows, in order:

    row                         kind                     computed by
    first_rows[i]               sample: the next token   the last known token of scheduled[i]
    first_rows[i] + 1 ..        drafts to verify         its drafts, one row per `row_depths` entry
    num_model_rows + ...        fanout children          a copy of their parent's sample row

A scheduled sequence that samples nothing this step (a prompt chunk short of its end, forced
tokens computed for their logprobs) has no row (`first_rows[i] == -1`). Known tokens whose logprobs
are wanted (prompt and forced tokens) are not logits rows: their hidden states go to
`weft.sample.prompt_logprobs` apart (`KnownSpan`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field

from weft.engine.block_table import BlockTableArray
from weft.engine.kv_cache import SeqBlocks
from weft.engine.sequence import Sequence
from weft.logprob_records import LogprobRef
from weft.structured.grammar import GrammarMatcher

NO_DRAFT_TOKENS: list[int] = []  # shared, never changed


@dataclass(slots=True)
class ScheduledSequence:
    seq: Sequence
    num_new_tokens: int
    table: SeqBlocks  # the sequence's whole block table after this step's allocation (and its row)
    samples: bool  # True when this step computes the sequence's last known token: it gets logits
    # Guessed tokens after the last known one, computed by this step (counted in `num_new_tokens`)
    # and verified by the sampling rows of their positions (weft/engine/speculation.py).
    drafts: list[int]
    # The draft positions whose tokens a grammar forces after the drafts before them: no row
    # samples them (weft/speculative/forced.py).
    rowless: tuple[int, ...] = ()

    @property
    def num_rows(self) -> int:
        """Its logits rows this step: its last known token's and one per draft (not the rowless
        ones), or none."""
        return self.samples + len(self.drafts) - len(self.rowless)

    @property
    def row_depths(self) -> Iterator[int]:
        """For each of its rows, how many drafts its input follows: 0 (its last known token), then
        the draft positions that have a row."""
        if not self.samples:
            return iter(())
        if not self.rowless:
            return iter(range(len(self.drafts) + 1))
        return (j for j in range(len(self.drafts) + 1) if j not in self.rowless)


@dataclass(frozen=True, slots=True)
class SchedulerOutput:
    scheduled: list[ScheduledSequence]
    num_batched_tokens: int
    block_copies: list[tuple[int, int]]  # (src, dst) block ids to copy before the forward pass
    num_preempted: int
    block_tables: BlockTableArray  # every table, one row each: `table.row` of each scheduled sequence
    # the sliding-window layers' pool (`KVCacheManager.window`): its copies, and its tables (rows
    # `table.window_row`); empty and None where the model keeps them in the one pool
    window_copies: list[tuple[int, int]] = field(default_factory=list)
    window_tables: BlockTableArray | None = None

    @property
    def sampling(self) -> list[Sequence]:
        """The sequences that sample this step, in logits-row order."""
        return [s.seq for s in self.scheduled if s.samples]

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


@dataclass(frozen=True, slots=True)
class SampledRows:
    """What the sampler produced, one entry per logits row (`StepLayout`)."""

    token_ids: list[int]
    logprobs: list[LogprobRef | None]
    errors: dict[int, str]  # row -> why that row failed


@dataclass(frozen=True, slots=True)
class Fanout:
    """Sequences sampled this step from another sequence's logits row: the other samples of an
    n > 1 request, forks of its first sequence taken before it sampled, drawn from the same
    distribution when its prompt's last token is computed. They then share all of its computed
    tokens: nothing is recomputed, and no block is copied unless they write into a shared one."""

    parent: Sequence
    parent_row: int  # the parent's sampling row
    children: list[Sequence]
    first_row: int  # the sampling row of the first child; the others follow


@dataclass(frozen=True, slots=True)
class Draft:
    """A sequence's guessed next tokens (`Speculation.propose`), and the positions among them whose
    tokens a grammar forces after the ones before (no row samples those)."""

    tokens: list[int]
    rowless: tuple[int, ...] = ()


NO_DRAFTS: Mapping[int, Draft] = {}

# (a row, its matcher, its drafts, its rowless draft positions)
GrammarRow = tuple[int, GrammarMatcher, list[int], tuple[int, ...]]

# (a sequence whose prompt ends this step, the room left under max_num_seqs) -> its fanout children
TakeFanout = Callable[[Sequence, int], list[Sequence]]


@dataclass(frozen=True, slots=True)
class StepLayout:
    """Whose each logits row of a step is (see the module's table), built once by `of`."""

    sched: SchedulerOutput
    first_rows: list[int]  # per scheduled sequence: the row of its last known token, or -1
    num_model_rows: int  # the rows the forward computes; the fanout rows follow them
    # the sequences that sample a token of their own this step (not a draft), in row order: each
    # scheduled one with a row, then the fanout children
    sequences: list[Sequence]
    # (row, matcher, drafts, rowless draft positions) of each constrained sequence's first row, in
    # row order (`GrammarManager.start_fill`)
    grammar_rows: list[GrammarRow]
    fanouts: list[Fanout] = field(default_factory=list)

    @classmethod
    def of(cls, sched: SchedulerOutput, take_fanout: TakeFanout | None = None, room: int = 0) -> StepLayout:
        """The rows of `sched`; `take_fanout` gives the fanout children of sequences whose prompt
        ends this step, `room` of them at most. (One pass over the batch: it runs every step.)"""
        first_rows: list[int] = []
        seqs: list[Sequence] = []
        constrained: list[GrammarRow] = []
        row = 0
        for item in sched.scheduled:
            if not item.samples:
                first_rows.append(-1)
                continue
            seq = item.seq
            first_rows.append(row)
            seqs.append(seq)
            if seq.matcher is not None:
                constrained.append((row, seq.matcher, item.drafts, item.rowless))
            row += 1 + len(item.drafts) - len(item.rowless)  # `num_rows`, inline
        layout = cls(sched, first_rows, row, seqs, constrained)
        if take_fanout is not None and room > 0:
            layout._add_fanouts(take_fanout, room)
        return layout

    def _add_fanouts(self, take_fanout: TakeFanout, room: int) -> None:
        """The children of the sequences whose prompt's last token this step computes (see
        `Fanout`), `room` of them at most, their rows after the step's own."""
        next_row = self.num_model_rows
        for item, row in zip(self.sched.scheduled, self.first_rows, strict=True):
            seq = item.seq
            if row < 0 or seq.num_computed_tokens + item.num_new_tokens != len(seq.prompt_token_ids):
                continue
            children = take_fanout(seq, room)
            if not children:
                continue
            self.fanouts.append(Fanout(seq, row, children, next_row))
            for child in children:
                self.sequences.append(child)
                if child.matcher is not None:
                    self.grammar_rows.append((next_row, child.matcher, NO_DRAFT_TOKENS, ()))
                next_row += 1
            room -= len(children)
            if room <= 0:
                break

    @property
    def num_rows(self) -> int:
        return self.num_model_rows + sum(len(f.children) for f in self.fanouts)

    @property
    def has_drafts(self) -> bool:
        return self.num_model_rows > len(self.sequences) - sum(len(f.children) for f in self.fanouts)

    def fanout_rows(self) -> list[int] | None:
        """The logits row each row of the step samples from ([S + F]: its own, or for a fanout
        child its parent's), or None without fanouts."""
        if not self.fanouts:
            return None
        return [*range(self.num_model_rows), *(f.parent_row for f in self.fanouts for _ in f.children)]

    def num_failed(self, errors: Mapping[int, str]) -> int:
        """How many sequences' own rows (not draft rows) are in `errors`."""
        if not errors:
            return 0
        if not self.has_drafts:
            return len(errors)
        own = {row for row in self.first_rows if row >= 0}
        return sum(1 for row in errors if row in own or row >= self.num_model_rows)
