"""Continuous batching.

Every sequence has one progress counter, `num_computed_tokens`, that catches up with `num_tokens`.
There is no prefill or decode phase: each step gives each sequence up to
`num_tokens - num_computed_tokens` new tokens, within the step's token budget. That one rule covers
prompts (chunked when long), decoding (one token), prefix-cache hits (counted as computed) and
tokens appended without sampling (not yet computed).

`schedule()`:
  1. serve running sequences first, oldest first; when blocks run out, preempt the newest running
     sequence (free its blocks, recompute it later) until the older one fits;
  2. admit waiting sequences in order while the budget, `max_num_seqs` and the free blocks allow,
     a fork with the blocks it shares with its parent (taken when it was queued), any other
     sequence from its longest prefix-cache hit.
When the step has run, `advance()` counts its tokens as computed and registers newly full blocks
for prefix caching; `accept()` hands each sampled token to its sequence from its row in the step's
layout (`weft/engine/layout.py`; `Sequence.append`, where the decision to stop is taken), and keeps
the drafts that speculation accepted. Whatever finished releases its blocks at once: `_release` is the
one place that happens. (A sequence whose finish waits for the logprobs of tokens a grammar forced
computes them without sampling, then finishes: `Sequence.pending_finish`.)
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Mapping

from weft.config import SchedulerConfig
from weft.engine.kv_cache import KVCacheManager, SeqBlocks
from weft.engine.layout import (
    NO_DRAFT_TOKENS,
    NO_DRAFTS,
    Draft,
    Fanout,
    SampledRows,
    ScheduledSequence,
    SchedulerOutput,
    StepLayout,
)
from weft.engine.sequence import FIRST_FINISHED, FinishReason, Sequence, SequenceStatus

# Verifies a scheduled sequence's drafts from the step's rows (its first row given) and appends what
# holds: (tokens a grammar forced, drafts accepted). `Speculation.verify`.
VerifyDrafts = Callable[[ScheduledSequence, SampledRows, int], tuple[int, int]]


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv: KVCacheManager) -> None:
        self.config = config
        self.kv = kv
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        """Queue a new sequence behind the waiting ones."""
        self.waiting.append(seq)

    def add_forked(self, forks: list[tuple[Sequence, Sequence]]) -> None:
        """Queue forks, (parent, child) pairs, ahead of the waiting sequences (they belong to
        requests already running). Each child takes its share of its parent's blocks at once,
        while the parent surely holds them (a parent pruned right after forking must not take them
        away); like every admission, running waits for room under `max_num_seqs`."""
        for parent, child in forks:
            self._share_parent_blocks(parent, child)
        self.resume([child for _, child in forks])

    def resume(self, seqs: list[Sequence]) -> None:
        """Queue sequences of running requests (forks, parked beams given a token) ahead of the
        waiting ones; whatever they computed and the blocks they hold stay theirs."""
        for seq in reversed(seqs):
            self.waiting.appendleft(seq)

    def _share_parent_blocks(self, parent: Sequence, seq: Sequence) -> None:
        """A fork shares the blocks of its parent's computed prefix and recomputes only its last
        token, for logits of its own (its first write copies the shared last block). A parent that
        finished or was preempted holds no blocks: the fork then starts like any new sequence,
        from the prefix cache."""
        num_shared = seq.num_tokens - seq.num_pending_forced - 1  # forced tokens wanting logprobs: computed
        if num_shared <= 0 or not self.kv.can_share(parent.seq_id, num_shared):
            return  # nothing to share (a one-token prompt), nothing held to share it from (or its window)
        if parent.num_computed_tokens < num_shared:
            return
        self.kv.fork(parent.seq_id, seq.seq_id, num_shared)
        seq.num_computed_tokens = num_shared

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running)

    def schedule(self, drafts: Mapping[int, Draft] = NO_DRAFTS) -> SchedulerOutput:
        """This step's tokens; `drafts`: guessed tokens of running sequences (by seq_id), computed
        after their last known token where the budget and the free blocks allow."""
        budget = self.config.max_num_batched_tokens
        scheduled: list[ScheduledSequence] = []
        num_preempted_before = self.num_preemptions
        budget = self._schedule_running(budget, scheduled, drafts)
        if self.num_preemptions == num_preempted_before:
            budget = self._schedule_waiting(budget, scheduled)
        return SchedulerOutput(
            scheduled=scheduled,
            num_batched_tokens=self.config.max_num_batched_tokens - budget,
            block_copies=self.kv.take_pending_copies(),
            num_preempted=self.num_preemptions - num_preempted_before,
            block_tables=self.kv.block_tables,
            window_copies=self.kv.take_window_copies(),
            window_tables=self.kv.window.block_tables if self.kv.window is not None else None,
        )

    def _schedule_running(
        self, budget: int, scheduled: list[ScheduledSequence], drafts: Mapping[int, Draft]
    ) -> int:
        idx = 0
        while idx < len(self.running) and budget > 0:
            seq = self.running[idx]
            num_new = min(_uncomputed(seq), budget)
            if num_new <= 0 or (seq.num_pending and seq.tokens_left <= 0):
                # (nothing new, or the pending token is its last: it finishes for length when read back)
                idx += 1
                continue
            if drafts:
                fitting = self._fitting_drafts(seq, num_new, budget, drafts)
                if fitting is not None:
                    scheduled.append(fitting)
                    budget -= fitting.num_new_tokens
                    idx += 1
                    continue
            table = self.kv.allocate_slots(seq, num_new)
            while table is None and not self.running[-1].num_pending:  # (see Sequence.add_pending)
                victim = self.running.pop()
                self._preempt(victim)
                if victim is seq:
                    break
                table = self.kv.allocate_slots(seq, num_new)
            if table is None:
                break
            scheduled.append(self._scheduled(seq, num_new, table))
            budget -= num_new
            idx += 1
        return budget

    def _fitting_drafts(
        self, seq: Sequence, num_new: int, budget: int, drafts: Mapping[int, Draft]
    ) -> ScheduledSequence | None:
        """`seq` scheduled with its drafts as far as the budget allows, with its blocks for them;
        None when it has none, its tokens this step stop short of its last, or the free blocks do
        not hold them (it is then scheduled without: drafts never preempt anything)."""
        draft = drafts.get(seq.seq_id)
        if draft is None or seq.num_computed_tokens + num_new != len(seq.token_ids):
            return None
        guessed = draft.tokens[: budget - num_new]
        table = self.kv.allocate_slots(seq, num_new + len(guessed)) if guessed else None
        if table is None:
            return None
        rowless = tuple(at for at in draft.rowless if at < len(guessed)) if draft.rowless else ()
        return ScheduledSequence(
            seq, num_new + len(guessed), table, self._samples(seq, num_new), guessed, rowless
        )

    def _schedule_waiting(self, budget: int, scheduled: list[ScheduledSequence]) -> int:
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            seq = self.waiting[0]
            table = self._allocate_fresh(seq, budget)
            if table is None and not self.running and self._preempt_waiting_holder():
                continue
            if table is None:
                break
            self.waiting.popleft()
            num_new = min(_uncomputed(seq), budget)
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            scheduled.append(self._scheduled(seq, num_new, table))
            budget -= num_new
        return budget

    def _allocate_fresh(self, seq: Sequence, budget: int) -> SeqBlocks | None:
        # Cached blocks have no logits: a hit stops before the positions whose logprobs are wanted.
        fresh = seq.num_computed_tokens == 0  # not a fork holding its parent's blocks, not parked
        computed = self.kv.get_computed_blocks(seq) if fresh else None
        num_cached = computed.num_tokens(self.kv.block_size) if computed else 0
        num_new = min(_uncomputed(seq, num_cached), budget)
        table = self.kv.allocate_slots(seq, num_new, computed)
        if table is None:
            return None
        if seq.status == SequenceStatus.WAITING and fresh:
            seq.num_cached_prompt_tokens = num_cached
            self.kv.record_prefix_query(seq.num_tokens, num_cached)
        seq.num_computed_tokens += num_cached
        return table

    def _scheduled(self, seq: Sequence, num_new: int, table: SeqBlocks) -> ScheduledSequence:
        return ScheduledSequence(seq, num_new, table, self._samples(seq, num_new), NO_DRAFT_TOKENS)

    @staticmethod
    def _samples(seq: Sequence, num_new: int) -> bool:
        """Whether `num_new` tokens reach `seq`'s last known token (a sequence whose finish waits
        for its forced tokens' logprobs computes them, and samples nothing)."""
        return seq.num_computed_tokens + num_new == len(seq.token_ids) and seq.pending_finish is None

    def _preempt(self, seq: Sequence) -> None:
        self._drop_blocks(seq)
        self.waiting.appendleft(seq)

    def _drop_blocks(self, seq: Sequence) -> None:
        self.kv.free(seq.seq_id)
        seq.num_computed_tokens = 0
        seq.status = SequenceStatus.PREEMPTED
        self.num_preemptions += 1

    def _preempt_waiting_holder(self) -> bool:
        """Nothing runs and the head of the queue gets no blocks: the rest of the cache is held by
        queued sequences (forks sharing their parent's blocks, resumed beams), which no step would
        ever free. The newest of them behind the head gives its blocks back and will recompute, as
        a preempted sequence does. False when none holds any."""
        for seq in reversed(self.waiting):
            if seq is self.waiting[0]:
                return False
            if self.kv.holds(seq.seq_id):
                self._drop_blocks(seq)
                return True
        return False

    def advance(self, output: SchedulerOutput) -> None:
        """The step's tokens are computed (their KV entries written, or being written by a step in
        flight): count them, and cache the blocks they filled."""
        for item in output.scheduled:
            if item.seq.status < FIRST_FINISHED:  # not finished (aborted) since it was scheduled
                self._computed(item)

    def _computed(self, item: ScheduledSequence) -> None:
        """Its known tokens are computed; its drafts count once accepted (`_keep_drafts`)."""
        seq = item.seq
        num_new = item.num_new_tokens - len(item.drafts)
        seq.num_computed_tokens += num_new
        if seq.num_computed_tokens % self.kv.block_size < num_new:  # a block filled up
            self.kv.cache_full_blocks(seq)

    def accept(self, layout: StepLayout, sampled: SampledRows, verify: VerifyDrafts | None = None) -> int:
        """Hand each sampled token of a step already counted as computed (`advance`) to its sequence,
        from its row in `layout`; a sequence with drafts is handed its rows by `verify`
        (`Speculation.verify`), and keeps the drafts it accepted. Sequences that finish release
        their blocks. Returns the number of tokens appended without sampling (forced by a grammar)."""
        by_parent = {f.parent.seq_id: f for f in layout.fanouts}
        token_ids, logprobs, errors = sampled.token_ids, sampled.logprobs, sampled.errors
        num_forced = 0
        for item, row in zip(layout.sched.scheduled, layout.first_rows, strict=True):
            seq = item.seq
            if seq.status >= FIRST_FINISHED:  # finished (aborted) since it was scheduled
                continue
            if by_parent:
                fanout = by_parent.get(seq.seq_id)
                num_forced += 0 if fanout is None else self._admit_fanout(fanout, sampled)
            if item.drafts:
                assert verify is not None, "a step with drafts is handed back with their verification"
                forced, accepted = verify(item, sampled, row)
                num_forced += forced
                self._keep_drafts(seq, accepted)
                continue
            if row < 0:
                if seq.pending_finish is not None and seq.num_computed_tokens == seq.num_tokens:
                    seq.finish_pending()
            elif errors or seq.defers_sampling:
                num_forced += self._accept(seq, sampled, row)
            else:  # the common case, inline: one row, one token (and those a grammar forced)
                num_appended = seq.append(token_ids[row], logprobs[row])
                if num_appended > 1:
                    num_forced += num_appended - 1
            if seq.status >= FIRST_FINISHED:  # `is_finished`, without the call (every row, every step)
                self._release(seq)
        return num_forced

    def _accept(self, seq: Sequence, sampled: SampledRows, row: int) -> int:
        """Hand sampling row `row` to `seq`: its error, its candidates (a parked beam), or its
        token. Returns the number of tokens the grammar forced after it."""
        error = sampled.errors.get(row)
        if error is not None:
            seq.finish(FinishReason.ERROR, error=error)
            return 0
        if seq.role is not None and seq.role.defers_sampling:
            seq.role.candidates = sampled.logprobs[row]
            self._park(seq)
            return 0
        return max(seq.append(sampled.token_ids[row], sampled.logprobs[row]) - 1, 0)

    def _keep_drafts(self, seq: Sequence, num_accepted: int) -> None:
        """After its drafts were verified: the KV entries of the first `num_accepted` stay computed,
        the rest are rolled back, and blocks past the sequence's tokens freed."""
        if seq.status >= FIRST_FINISHED:
            self._release(seq)
            return
        # Forced tokens wanting logprobs need the hidden state before them recomputed.
        seq.num_computed_tokens = min(seq.num_computed_tokens + num_accepted, seq.first_position_needed)
        self.kv.truncate(seq.seq_id, seq.num_tokens)
        if num_accepted:
            self.kv.cache_full_blocks(seq)

    def _admit_fanout(self, fanout: Fanout, sampled: SampledRows) -> int:
        """The fanout's children join the running batch sharing every computed token of their
        parent (before it can finish and release them), each with its own sampled token."""
        num_forced = 0
        parent = fanout.parent
        for i, child in enumerate(fanout.children):
            if child.is_finished:  # aborted with its request
                continue
            row = fanout.first_row + i
            self.kv.fork(parent.seq_id, child.seq_id, parent.num_computed_tokens)
            child.num_computed_tokens = parent.num_computed_tokens
            child.status = SequenceStatus.RUNNING
            self.running.append(child)
            num_forced += self._accept(child, sampled, row)
            if child.is_finished:
                self._release(child)
        return num_forced

    def _park(self, seq: Sequence) -> None:
        """Out of the running set, keeping its blocks and computed tokens, until `resume`."""
        self.running.remove(seq)
        seq.status = SequenceStatus.PARKED

    def finish(
        self,
        seq: Sequence,
        reason: FinishReason,
        stop_reason: str | int | None = None,
        error: str | None = None,
    ) -> None:
        """Finish `seq` now (an abort, a prune) and release its blocks."""
        if not seq.is_finished:
            seq.finish(reason, stop_reason, error)
        self._release(seq)

    def _release(self, seq: Sequence) -> None:
        """The one place a finished sequence leaves the queues and gives its blocks back."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.kv.free(seq.seq_id)


def _uncomputed(seq: Sequence, num_cached: int = 0) -> int:
    """The tokens `seq` may compute in one step, after `num_cached` more from the prefix cache: all
    it has not, but where a preempted sequence recomputes its prompt, up to the prompt's end. Its
    generated tokens then come in a step of their own, as a row of generated tokens, which
    attends token by token and multiplies through the panels as decoding did (`StepPlan`): a
    sequence's numbers after a preemption are those it had before."""
    start, num_prompt = seq.num_computed_tokens + num_cached, len(seq.prompt_token_ids)
    return (num_prompt if start < num_prompt else len(seq.token_ids)) - start
