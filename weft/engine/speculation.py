"""Speculative decoding in the engine: which sequences draft, and the rows that verify drafts.

Before each step, every running sequence that is about to sample (its last known token computed
by this step, nothing pending) may guess its next tokens (`Speculation.propose`, a `Drafter` per
sequence). Under a grammar the guesses are cut at the first token the matcher refuses, checked
without advancing it. The scheduler computes the drafts after the last known token where the budget
and the free blocks allow (`Scheduler.schedule(drafts)`), so one forward gives logits for every
draft position; row j of a sequence samples as the sequence would after its first j drafts
(`DraftRow`), with the grammar's mask after them (filled in the same pass as every other mask,
`GrammarManager.start_fill`). `Scheduler._accept_drafts` then appends the sampled tokens while each
equals the draft it follows and rolls the rest back. The tokens are exactly those of decoding without
speculation: a row's token depends only on its logits and on the sequence as it stands there.
"""

from __future__ import annotations

from collections.abc import Iterable

from weft.config import SpeculativeConfig
from weft.engine.scheduler import SchedulerOutput
from weft.engine.sequence import Sequence, SequenceStatus
from weft.sample.sampler import SamplingRow
from weft.speculative.drafter import DrafterFactory, DraftState, Tally, drafter_factory
from weft.speculative.forced import through_forced
from weft.speculative.policy import GATE_KNOWN_MOST, POOLED_DECAY, Acceptance, DraftGate, StepCost
from weft.speculative.suffix import SuffixCache
from weft.tokenizer import Tokenizer


class Speculation:
    def __init__(self, config: SpeculativeConfig, tokenizer: Tokenizer | None = None) -> None:
        self.config = config
        self.cache = None  # suffix decoding's outputs of recent sequences
        if config.method == "suffix":
            self.cache = SuffixCache(
                config.suffix_decoding_max_tree_depth, config.suffix_decoding_max_cached_requests
            )
        self.new_drafter: DrafterFactory = drafter_factory(config, tokenizer, self.cache)  # tests: their own
        self.tally = Tally()  # the engine's, over every verification
        self.acceptance = Acceptance(decay=POOLED_DECAY)  # the engine's: new sequences start from it
        self.cost = StepCost()  # what a token costs a decode step (weft/speculative/policy.py)
        self.gate = DraftGate()  # which steps pay, drafting or plain, per batch size
        self.adaptive = True  # draft only the tokens that pay; False: always as many as proposed
        self._kept_seen = 0  # the tally's kept draft tokens (guesses and forced) at the last step observed
        self._next_allowed: bool | None = None  # the gate's answer for the next step, if asked early

    def propose(self, running: Iterable[Sequence]) -> dict[int, list[int]]:
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
            state = seq.drafts
            if state is None:
                state = seq.drafts = self._new_state()
            room = seq.tokens_left - 1  # the last token comes from a row, not a draft
            wanted = state.acceptance.num_tokens(share, min(k, room)) if room > 0 else 0
            guessed = state.drafter.propose(seq.token_ids, wanted) if wanted > 0 else []
            if state.forced_at:
                state.forced_at = []
            if guessed and seq.matcher is not None:
                guessed = self._under_grammar(seq, state, guessed, (wanted, room), share)
            if guessed:
                drafts[seq.seq_id] = guessed
        return drafts

    def _extracts(self, seq: Sequence) -> bool:
        """Whether `seq` writes JSON under a grammar (fast-forwarding, no logprobs) from a prompt
        that states `key: value` lines: an extraction, whose value guesses are drafted whatever the
        step gate says (they are right or cut at once; their own acceptance estimate still sets
        how many), since the gate, measuring steps, cannot tell the few steps where a value opens."""
        if seq.matcher is None or not seq.params.fast_forward or seq.position_outputs is not None:
            return False
        if not seq.params.speculative:
            return False
        state = seq.drafts
        if state is None:
            state = seq.drafts = self._new_state()
        states_fields = getattr(state.drafter, "states_fields", None)
        return states_fields is not None and states_fields(seq.prompt_token_ids)

    def _new_state(self) -> DraftState:
        """A sequence's speculation, its acceptance starting from the engine's."""
        pooled = self.acceptance
        acceptance = Acceptance.starting_at(pooled.rate)
        return DraftState(self.new_drafter(), self.tally, acceptance=acceptance, engine_acceptance=pooled)

    @staticmethod
    def _under_grammar(
        seq: Sequence, state: DraftState, guessed: list[int], most: tuple[int, int], share: float
    ) -> list[int]:
        """The guesses cut at the first token the grammar refuses; if it refuses none, and the
        sequence fast-forwards without logprobs, run on through what the grammar forces after them
        (weft/speculative/forced.py) where that pays. `most`: guesses and tokens at most."""
        matcher = seq.matcher
        assert matcher is not None
        valid = matcher.validate(guessed)
        if valid < len(guessed) or not seq.params.fast_forward or seq.position_outputs is not None:
            return guessed[:valid]
        propose_after = getattr(state.drafter, "propose_after", None)
        rate = state.acceptance.rate
        guessed, state.forced_at = through_forced(
            matcher, propose_after, seq.token_ids, guessed, *most, rate, share
        )
        return guessed

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
            if seq.is_finished and seq.drafts is not None:
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

    @staticmethod
    def rows(sched: SchedulerOutput) -> list[SamplingRow]:
        """The step's sampling rows in logits order: each sampling sequence, then its draft rows."""
        rows: list[SamplingRow] = []
        for item in sched.scheduled:
            if not item.samples:
                continue
            rows.append(item.seq)
            if item.drafts:
                state = item.seq.drafts
                assert state is not None
                rows += state.draft_rows(item.seq, item.drafts, item.rowless)
        return rows


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
