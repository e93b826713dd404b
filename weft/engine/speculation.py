"""Speculative decoding in the engine: which sequences draft, the rows that verify drafts, and what
they accept. The engine always holds one (`SpeculationOff` when `speculative_config` is unset), and
calls it the same way whether it drafts or not.

Before each step, every running sequence that is about to sample (its last known token computed
by this step, nothing pending) may guess its next tokens (`Speculation.propose`, a `Drafter` per
sequence). Under a grammar the guesses are cut at the first token the matcher refuses, checked
without advancing it. The scheduler computes the drafts after the last known token where the budget
and the free blocks allow (`Scheduler.schedule(drafts)`), so one forward gives logits for every
draft position; row j of a sequence samples as the sequence would after its first j drafts
(`DraftRow`), with the grammar's mask after them (filled in the same pass as every other mask,
`GrammarManager.start_fill`). `Speculation.verify` then appends the sampled tokens while each
equals the draft it follows, and the scheduler keeps their KV entries and rolls the rest back
(`Scheduler._keep_drafts`). The tokens are exactly those of decoding without speculation: a row's
token depends only on its logits and on the sequence as it stands there.

Each sequence's speculation (its drafter, acceptance estimate and tally: `DraftState`) lives here,
keyed by its seq_id, made on its first draft and forgotten when its request is done (`forget`).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from collections.abc import Sequence as Sequence_

from weft.config import SpeculativeConfig
from weft.engine.layout import NO_DRAFTS, Draft, SampledRows, ScheduledSequence, SchedulerOutput, StepLayout
from weft.engine.sequence import FIRST_FINISHED, FinishReason, Sequence, SequenceStatus
from weft.outputs import SpeculationCounts
from weft.sample.sampler import SamplingRow
from weft.speculative.drafter import DrafterFactory, DraftState, Tally, drafter_factory
from weft.speculative.forced import through_forced
from weft.speculative.policy import GATE_KNOWN_MOST, POOLED_DECAY, Acceptance, DraftGate, StepCost
from weft.speculative.suffix import SuffixCache
from weft.tokenizer import Tokenizer


class SpeculationOff:
    """Speculation when the engine does not speculate: no drafts, so every row is a sequence's
    own, and nothing to verify, observe or count."""

    def __init__(self) -> None:
        self.tally = Tally()  # stays empty

    def propose(self, running: Iterable[Sequence]) -> Mapping[int, Draft]:
        return NO_DRAFTS

    def lets_stay_in_flight(self, proposed: bool, running: list[Sequence]) -> bool:
        return True

    def observe(self, sched: SchedulerOutput, seconds: float) -> None:
        return None

    def sampling_rows(self, layout: StepLayout) -> Sequence_[SamplingRow]:
        """The step's sampling rows in logits order (`StepLayout`)."""
        return layout.sequences

    def verify(self, item: ScheduledSequence, sampled: SampledRows, row: int) -> tuple[int, int]:
        raise AssertionError("no drafts are scheduled where speculation is off")

    def retire(self, seqs: Iterable[Sequence]) -> None:
        return None

    def counts(self, seqs: Iterable[Sequence]) -> SpeculationCounts | None:
        return None

    def forget(self, seqs: Iterable[Sequence]) -> None:
        return None

    def stats(self) -> dict[str, int]:
        return {}


class Speculation(SpeculationOff):
    def __init__(self, config: SpeculativeConfig, tokenizer: Tokenizer | None = None) -> None:
        super().__init__()
        self.config = config
        self.cache = None  # suffix decoding's outputs of recent sequences
        if config.method == "suffix":
            self.cache = SuffixCache(
                config.suffix_decoding_max_tree_depth, config.suffix_decoding_max_cached_requests
            )
        self.new_drafter: DrafterFactory = drafter_factory(config, tokenizer, self.cache)  # tests: their own
        self.states: dict[int, DraftState] = {}  # by seq_id: each drafting sequence's
        self.tally = Tally()  # the engine's, over every verification
        self.acceptance = Acceptance(decay=POOLED_DECAY)  # the engine's: new sequences start from it
        self.cost = StepCost()  # what a token costs a decode step (weft/speculative/policy.py)
        self.gate = DraftGate()  # which steps pay, drafting or plain, per batch size
        self.adaptive = True  # draft only the tokens that pay; False: always as many as proposed
        self._kept_seen = 0  # the tally's kept draft tokens (guesses and forced) at the last step observed
        self._next_allowed: bool | None = None  # the gate's answer for the next step, if asked early

    def propose(self, running: Iterable[Sequence]) -> Mapping[int, Draft]:
        """Drafts of the running sequences that may speculate this step, by seq_id."""
        k = self.config.num_speculative_tokens
        running = list(running)
        allowed, self._next_allowed = self._next_allowed, None
        if allowed is None and self.adaptive:
            allowed = self.gate.allows(len(running))
        share = self.cost.share(len(running)) if self.adaptive else 0.0
        if allowed is False:  # only extractions draft (`_extracts`)
            running = [seq for seq in running if self._extracts(seq)]
        drafts = {}
        for seq in running:
            if not _may_draft(seq):
                continue
            state = self._state(seq)
            room = seq.tokens_left - 1  # the last token comes from a row, not a draft
            wanted = state.acceptance.num_tokens(share, min(k, room)) if room > 0 else 0
            guessed = state.drafter.propose(seq.token_ids, wanted) if wanted > 0 else []
            if guessed and seq.matcher is not None:
                draft = self._under_grammar(seq, state, guessed, (wanted, room), share)
                if draft.tokens:
                    drafts[seq.seq_id] = draft
            elif guessed:
                drafts[seq.seq_id] = Draft(guessed)
        return drafts

    def _state(self, seq: Sequence) -> DraftState:
        """`seq`'s speculation, made on first use, its acceptance starting from the engine's."""
        state = self.states.get(seq.seq_id)
        if state is None:
            pooled = self.acceptance
            acceptance = Acceptance.starting_at(pooled.rate)
            state = DraftState(
                self.new_drafter(), self.tally, acceptance=acceptance, engine_acceptance=pooled
            )
            self.states[seq.seq_id] = state
        return state

    def _extracts(self, seq: Sequence) -> bool:
        """Whether `seq` writes JSON under a grammar (fast-forwarding, no logprobs) from a prompt
        that states `key: value` lines: an extraction, whose value guesses are drafted whatever the
        step gate says (they are right or cut at once; their own acceptance estimate still sets
        how many), since the gate, measuring steps, cannot tell the few steps where a value opens."""
        if seq.matcher is None or not seq.params.fast_forward or seq.position_outputs is not None:
            return False
        if not seq.params.speculative:
            return False
        states_fields = getattr(self._state(seq).drafter, "states_fields", None)
        return states_fields is not None and states_fields(seq.prompt_token_ids)

    @staticmethod
    def _under_grammar(
        seq: Sequence, state: DraftState, guessed: list[int], most: tuple[int, int], share: float
    ) -> Draft:
        """The guesses cut at the first token the grammar refuses; if it refuses none, and the
        sequence fast-forwards without logprobs, run on through what the grammar forces after them
        (weft/speculative/forced.py) where that pays. `most`: guesses and tokens at most."""
        matcher = seq.matcher
        assert matcher is not None
        valid = matcher.validate(guessed)
        if valid < len(guessed) or not seq.params.fast_forward or seq.position_outputs is not None:
            return Draft(guessed[:valid])
        propose_after = getattr(state.drafter, "propose_after", None)
        rate = state.acceptance.rate
        tokens, forced_at = through_forced(matcher, propose_after, seq.token_ids, guessed, *most, rate, share)
        return Draft(tokens, tuple(forced_at))

    def lets_stay_in_flight(self, proposed: bool, running: list[Sequence]) -> bool:
        """Whether a step may stay in flight (lookahead): only if no drafts were `proposed` for it
        and the next step, of the `running` sequences, will not draft (drafts are looked up in
        tokens on the host): no extraction runs (`_extracts`) and the gate, asked for the next
        step now (`propose` keeps its answer), keeps drafting off."""
        if not self.adaptive or proposed or any(self._extracts(seq) for seq in running):
            return False
        self._next_allowed = self.gate.allows(len(running))
        return not self._next_allowed

    def retire(self, seqs: Iterable[Sequence]) -> None:
        """Sequences that finished this step: suffix decoding keeps their outputs for later ones."""
        if self.cache is None:
            return
        for seq in seqs:
            if seq.is_finished and seq.seq_id in self.states:
                self.cache.add(seq.seq_id, seq.output_token_ids)

    def observe(self, sched: SchedulerOutput, seconds: float) -> None:
        """A step took `seconds`, from its drafts' lookup to its tokens' acceptance: a decode step
        (one known token per row, and drafts) refines what a token costs; a step whose every row
        samples after at most `GATE_KNOWN_MOST` known tokens (a decode token and tokens a grammar
        forced before it; not a prompt) refines what a drafting and a plain step produce per
        second. A step produces the tokens it computes and keeps: its known tokens and its accepted
        drafts (forced tokens count in the step that computes them, not in the one they follow)."""
        num_drafts = sum(len(item.drafts) for item in sched.scheduled)
        tally = self.tally
        kept = tally.num_accepted_tokens + tally.num_forced_kept
        accepted, self._kept_seen = kept - self._kept_seen, kept
        known = sched.num_batched_tokens - num_drafts
        if known == len(sched.scheduled):
            self.cost.record(sched.num_batched_tokens, seconds)
        if all(
            item.samples and item.num_new_tokens - len(item.drafts) <= GATE_KNOWN_MOST
            for item in sched.scheduled
        ):
            self.gate.record(len(sched.scheduled), known + accepted, seconds, drafted=num_drafts > 0)

    def sampling_rows(self, layout: StepLayout) -> Sequence_[SamplingRow]:
        """The step's sampling rows in logits order: each sampling sequence, then its draft rows
        (`DraftRow`); the fanout children last."""
        rows: list[SamplingRow] = []
        for item in layout.sched.scheduled:
            if not item.samples:
                continue
            rows.append(item.seq)
            if item.drafts:
                rows += self.states[item.seq.seq_id].draft_rows(item.seq, item.drafts, item.rowless)
        for fanout in layout.fanouts:
            rows += fanout.children
        return rows

    def verify(self, item: ScheduledSequence, sampled: SampledRows, row: int) -> tuple[int, int]:
        """Verify `item`'s drafts from its rows (`row`: its last known token's): each sampled token
        is appended as it would be without speculation, and the next row counts only while the
        token equals the draft its row was computed after. Tokens a grammar forces after it end the
        run, unless the draft holds them too (weft/speculative/forced.py): the run then goes on
        after them. Returns (tokens the grammar forced, drafts accepted: their KV entries, computed
        after the right tokens, hold)."""
        seq, drafts, rowless = item.seq, item.drafts, item.rowless
        num_forced = num_accepted = 0
        depth = 0
        while depth <= len(drafts):
            at = row + depth - sum(1 for skipped in rowless if skipped < depth)  # its row
            error = sampled.errors.get(at)
            if error is not None:
                seq.finish(FinishReason.ERROR, error=error)
                break
            token = sampled.token_ids[at]
            num_appended = seq.append(token, sampled.logprobs[at])
            num_forced += max(num_appended - 1, 0)
            if depth == len(drafts) or token != drafts[depth] or num_appended == 0:
                break
            num_accepted += 1  # its KV entry, computed after the right token, holds
            held = _forced_held(seq, drafts, depth, num_appended - 1)
            num_accepted += held
            if held < num_appended - 1 or seq.status >= FIRST_FINISHED:
                break
            depth += num_appended
            if depth in rowless:  # forced tokens the draft expected and `append` did not add
                break
        self._record(item, num_accepted)
        return num_forced, num_accepted

    def _record(self, item: ScheduledSequence, num_accepted: int) -> None:
        """The verification (`num_accepted`: the drafts' first tokens kept) in the sequence's
        tallies, of its guesses only: the tokens a grammar forced that its draft held (`rowless`)
        are neither drafted nor accepted there."""
        state = self.states.get(item.seq.seq_id)
        if state is None:  # (verified drafts it did not propose: tests)
            return
        num_forced_kept = sum(1 for at in item.rowless if at < num_accepted)
        state.record(len(item.drafts) - len(item.rowless), num_accepted - num_forced_kept, num_forced_kept)

    def counts(self, seqs: Iterable[Sequence]) -> SpeculationCounts | None:
        """The drafts of a request's sequences and their accepted tokens; None without any."""
        tallies = [state.tally for state in map(self.states.get, (s.seq_id for s in seqs)) if state]
        if not tallies:
            return None
        return sum((t.counts for t in tallies[1:]), tallies[0].counts)

    def forget(self, seqs: Iterable[Sequence]) -> None:
        """Sequences gone for good (their request done, pruned): their speculation goes too."""
        for seq in seqs:
            self.states.pop(seq.seq_id, None)

    def stats(self) -> dict[str, int]:
        """The drafts verified, their tokens and the tokens accepted, as vLLM counts them
        (`spec_decode_*`)."""
        tally = self.tally
        return {
            "spec_decode_num_drafts": tally.num_drafts,
            "spec_decode_num_draft_tokens": tally.num_draft_tokens,
            "spec_decode_num_accepted_tokens": tally.num_accepted_tokens,
        }


def _forced_held(seq: Sequence, drafts: list[int], depth: int, num_forced: int) -> int:
    """How many of the `num_forced` tokens that `seq` has just appended after drafts[depth],
    forced by its grammar, the drafts hold next, in order (none while they wait for logprobs)."""
    if num_forced == 0 or seq.num_pending_forced:
        return 0
    forced = seq.token_ids[len(seq.token_ids) - num_forced :]
    held = 0
    for token, draft in zip(forced, drafts[depth + 1 :], strict=False):
        if token != draft:
            break
        held += 1
    return held


def _may_draft(seq: Sequence) -> bool:
    """Whether `seq` may guess its next tokens now: running, nothing pending (a token in flight,
    forced tokens awaiting their logprobs, a finish), not choosing its tokens by policy (beams)."""
    return (
        seq.status == SequenceStatus.RUNNING
        and not seq.num_pending
        and not seq.num_pending_forced
        and seq.pending_finish is None
        and not seq.defers_sampling
        and seq.params.speculative
    )
