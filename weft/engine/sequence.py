"""One stream of tokens being generated: its tokens, progress, grammar, text, stop state and logprobs.

A `Sequence` is the single owner of everything that belongs to one stream. `append()` is the one
place where a sampled token is accepted; `fork()` copies the whole state at any depth (the grammar
matcher forked from its current state, never recompiled or replayed). The KV blocks of a sequence
belong to the KV manager, keyed by `seq_id`; the scheduler releases them when the sequence finishes.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace
from enum import IntEnum, StrEnum
from typing import TYPE_CHECKING

from weft.detokenize import ByteLevelDetokenizer, new_detokenizer
from weft.logprob_records import LazyPositions, LogprobRef
from weft.outputs import CompletionOutput, PositionLogprobs
from weft.params import OutputKind, SamplingParams
from weft.structured.grammar import GrammarMatcher
from weft.tokenizer import IncrementalDetokenizer, StopStringMatcher, Tokenizer

if TYPE_CHECKING:
    from weft.engine.group import SequenceGroup


class FinishReason(StrEnum):
    STOP = "stop"  # EOS, a stop token, a stop string, or a finished grammar
    LENGTH = "length"  # max_tokens or max_model_len reached
    ABORT = "abort"
    ERROR = "error"  # this sequence failed (for example its grammar); the batch went on
    PRUNED = "pruned"  # released by its group's policy (a beam that fell out); never reported


class SequenceStatus(IntEnum):
    """Ordered so that every status >= FINISHED_STOPPED is final."""

    WAITING = 0
    RUNNING = 1
    PREEMPTED = 2
    PARKED = 3  # computed, holding its blocks, waiting for its group's policy to give it a token
    FINISHED_STOPPED = 4
    FINISHED_LENGTH = 5
    FINISHED_ABORTED = 6
    FINISHED_ERROR = 7
    FINISHED_PRUNED = 8

    @property
    def is_finished(self) -> bool:
        return self >= SequenceStatus.FINISHED_STOPPED


FIRST_FINISHED = SequenceStatus.FINISHED_STOPPED  # status >= it: finished
PENDING_TOKEN = -1  # a token a step in flight is sampling (`Sequence.add_pending`); never an input
_DELTA = OutputKind.DELTA  # hot paths read enum members from module constants (an Enum class
# attribute costs ~15x a global's on Python 3.11)
_FINISHED_STATUS = {
    FinishReason.STOP: SequenceStatus.FINISHED_STOPPED,
    FinishReason.LENGTH: SequenceStatus.FINISHED_LENGTH,
    FinishReason.ABORT: SequenceStatus.FINISHED_ABORTED,
    FinishReason.ERROR: SequenceStatus.FINISHED_ERROR,
    FinishReason.PRUNED: SequenceStatus.FINISHED_PRUNED,
}


@dataclass(frozen=True, slots=True)
class SequenceLimits:
    """What every sequence of an engine stops at."""

    max_model_len: int
    eos_token_ids: frozenset[int]


@dataclass(slots=True)
class OutputCursor:
    """How much of a sequence's output has been handed out already (for DELTA outputs)."""

    num_chars: int = 0
    num_tokens: int = 0
    num_logprobs: int = 0


@dataclass(slots=True, eq=False)
class Sequence:
    """One sequence. `token_ids` holds the prompt followed by the output; `num_computed_tokens`
    counts the leading tokens whose KV entries are in the cache, and catches up with `num_tokens`.
    There is no prefill or decode mode: a prompt, a resumed preempted sequence and tokens appended
    without sampling are all simply tokens not yet computed."""

    seq_id: int  # internal, unique within the engine
    index: int  # its place in the request's output
    params: SamplingParams
    prompt_token_ids: list[int]  # shared with the group and the other sequences; never modified
    limits: SequenceLimits
    seed: int  # the request's seed (+ index), or one drawn for it: randomness is keyed by (seed, position)
    detokenizer: IncrementalDetokenizer | ByteLevelDetokenizer
    stop_matcher: StopStringMatcher
    token_ids: list[int]
    group: SequenceGroup | None = None
    matcher: GrammarMatcher | None = None
    num_computed_tokens: int = 0
    status: SequenceStatus = SequenceStatus.WAITING
    finish_reason: FinishReason | None = None
    stop_reason: str | int | None = None
    error: str | None = None
    text: str = ""
    logprobs: list[LogprobRef] | None = None  # made PositionLogprobs when an output is read
    constraint_logmass: list[float] | None = None  # per position, with logprobs
    text_offsets: list[int] | None = None  # per output token, with logprobs: where its text starts
    forced: list[bool] | None = None  # per position, with logprobs: appended by fast-forward
    # With logprobs, tokens the grammar forced are computed (and get their logprobs) in the next
    # step: the last `num_pending_forced` tokens still lack them, and a finish decided meanwhile
    # waits in `pending_finish` until they are computed (`Scheduler.update` applies it).
    num_pending_forced: int = 0
    pending_finish: tuple[FinishReason, str | int | None] | None = None
    cumulative_logprob: float | None = None
    prompt_logprobs: list[PositionLogprobs | None] | None = None  # [None] + one per prompt token
    num_cached_prompt_tokens: int = 0
    num_preemptions: int = 0
    fork_parent: Sequence | None = None  # set until the scheduler queues a fork: share its blocks
    # Set by a policy that chooses this sequence's tokens itself (beam search): a step that computes
    # it leaves its top logprobs in `candidates` and parks it instead of appending a sampled token.
    defers_sampling: bool = False
    candidates: LogprobRef | None = None
    sent: OutputCursor = field(default_factory=OutputCursor)
    arrival_time: float = field(default_factory=time.monotonic)
    # The token stop rules, resolved once from params and limits (`Sequence.create`): the ids that
    # end the sequence once it has min_tokens (stop tokens, and EOS unless ignored), and the total
    # token count at which it stops for length (max_tokens after the prompt, or max_model_len).
    stop_ids: frozenset[int] = frozenset()
    max_num_tokens: int = 0
    # 1 while the last entry of `token_ids` is `PENDING_TOKEN`: the token a step still in flight is
    # sampling, which the next step already computes (the engine's lookahead, `lookahead.commit`).
    num_pending: int = 0

    @classmethod
    def create(
        cls,
        seq_id: int,
        params: SamplingParams,
        prompt_token_ids: list[int],
        limits: SequenceLimits,
        seed: int,
        tokenizer: Tokenizer,
    ) -> Sequence:
        wants_logprobs = params.logprobs is not None
        stop_ids = frozenset(params.stop_token_ids or ()) | (
            frozenset() if params.ignore_eos else limits.eos_token_ids
        )
        max_num_tokens = limits.max_model_len
        if params.max_tokens is not None:
            max_num_tokens = min(max_num_tokens, len(prompt_token_ids) + params.max_tokens)
        return cls(
            seq_id=seq_id,
            index=0,
            params=params,
            prompt_token_ids=prompt_token_ids,
            limits=limits,
            seed=seed,
            detokenizer=new_detokenizer(tokenizer, prompt_token_ids, params.skip_special_tokens),
            stop_matcher=StopStringMatcher(params.stop_strings, params.include_stop_str_in_output),
            token_ids=list(prompt_token_ids),
            logprobs=[] if wants_logprobs else None,
            constraint_logmass=[] if wants_logprobs else None,
            text_offsets=[] if wants_logprobs else None,
            forced=[] if wants_logprobs else None,
            cumulative_logprob=0.0 if wants_logprobs else None,
            prompt_logprobs=[None] if params.prompt_logprobs is not None else None,
            stop_ids=stop_ids,
            max_num_tokens=max_num_tokens,
        )

    # ---- counts -----------------------------------------------------------------------------

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - len(self.prompt_token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[len(self.prompt_token_ids) :]

    @property
    def eos_token_ids(self) -> frozenset[int]:
        return self.limits.eos_token_ids

    @property
    def is_finished(self) -> bool:
        return self.status >= FIRST_FINISHED

    @property
    def needs_prompt_logprobs(self) -> bool:
        """Whether prompt tokens still lack their logprobs (so they must be computed, not cached)."""
        return self.prompt_logprobs is not None and len(self.prompt_logprobs) < len(self.prompt_token_ids)

    @property
    def first_position_needed(self) -> int:
        """The first position whose hidden state this sequence still needs: the last token's (to
        sample), the one before its first forced token without a logprob, or the one before its
        first prompt token without one. A prefix-cache hit must stop before it."""
        position = self.num_tokens - self.num_pending_forced - 1
        if self.prompt_logprobs is not None:
            position = min(position, len(self.prompt_logprobs) - 1)
        return position

    def add_prompt_logprobs(self, first_token: int, items: list[LogprobRef]) -> None:
        """Logprobs of prompt tokens `first_token`, `first_token + 1`, ... (each entry's column 0 is
        the actual token). Tokens already recorded (a recompute after preemption) are skipped."""
        assert self.prompt_logprobs is not None
        texts = self.detokenizer.tokenizer.token_texts
        num_top = self.params.prompt_logprobs or 0
        for offset, item in enumerate(items):
            if first_token + offset != len(self.prompt_logprobs):
                continue
            self.prompt_logprobs.append(item.position(num_top, texts))

    def add_forced_logprobs(self, first_token: int, items: list[LogprobRef]) -> None:
        """The model's logprobs of forced tokens `first_token`, `first_token + 1`, ... (computed like
        prompt tokens; column 0 is the forced token). Tokens already recorded are skipped."""
        for offset, item in enumerate(items):
            if first_token + offset == self.num_tokens - self.num_pending_forced:
                self._add_logprobs(item, forced=True)
                self.num_pending_forced -= 1

    # ---- the life cycle ---------------------------------------------------------------------

    def finish(
        self, reason: FinishReason, stop_reason: str | int | None = None, error: str | None = None
    ) -> None:
        """Mark the sequence finished and drop its matcher. Its KV blocks are released by the
        scheduler, which sees the status (`Scheduler.update`, `Scheduler.finish`). A stop or a
        length limit reached while forced tokens still lack their logprobs waits for them
        (`pending_finish`); an abort, a prune or an error does not."""
        if self.num_pending_forced and reason in (FinishReason.STOP, FinishReason.LENGTH):
            if self.pending_finish is None or stop_reason is not None:
                self.pending_finish = (reason, stop_reason)
            return
        self.num_pending_forced, self.pending_finish = 0, None
        if self.num_pending:  # finished (aborted) while a step in flight samples its next token
            self._drop_pending()
        self.status = _FINISHED_STATUS[reason]
        self.finish_reason, self.stop_reason, self.error = reason, stop_reason, error
        self.matcher = None
        self.fork_parent = None

    @property
    def is_finishing(self) -> bool:
        """Finished, or finished as soon as its pending forced tokens are computed."""
        return self.status >= FIRST_FINISHED or self.pending_finish is not None

    def finish_pending(self) -> None:
        """Apply the finish that waited for the forced tokens' logprobs (all computed now)."""
        assert self.pending_finish is not None
        reason, stop_reason = self.pending_finish
        self.num_pending_forced = 0
        self.finish(reason, stop_reason)

    def complete_with(self, token_ids: list[int], text: str, cumulative_logprob: float) -> None:
        """Finish with an output chosen as a whole (exact choice selection), not decoded."""
        self.token_ids.extend(token_ids)
        self.text = text
        self.cumulative_logprob = cumulative_logprob
        self.finish(FinishReason.STOP)

    def fork(self, seq_id: int, index: int, seed: int) -> Sequence:
        """A child that continues exactly as this sequence would from here: copied tokens, text,
        logprobs and stop state, the matcher forked from its current state. It has computed
        nothing yet; the scheduler shares this sequence's KV blocks with it when it admits it."""
        assert not self.num_pending, "forked by its group's policy, so never with a token in flight"
        return replace(
            self,
            seq_id=seq_id,
            index=index,
            seed=seed,
            detokenizer=self.detokenizer.fork(),
            token_ids=list(self.token_ids),
            matcher=None if self.matcher is None else self.matcher.fork(),
            num_computed_tokens=0,
            status=SequenceStatus.WAITING,
            finish_reason=None,
            stop_reason=None,
            error=None,
            logprobs=None if self.logprobs is None else list(self.logprobs),
            constraint_logmass=None if self.constraint_logmass is None else list(self.constraint_logmass),
            text_offsets=None if self.text_offsets is None else list(self.text_offsets),
            forced=None if self.forced is None else list(self.forced),
            prompt_logprobs=None if self.prompt_logprobs is None else list(self.prompt_logprobs),
            fork_parent=self,
            candidates=None,
            sent=replace(self.sent),
        )

    def add_pending(self) -> None:
        """Stand in for the token a step in flight samples, so that the next step can be scheduled
        (and compute it, its value taken on the device) before it is known."""
        self.token_ids.append(PENDING_TOKEN)
        self.num_pending = 1

    def _drop_pending(self) -> None:
        self.token_ids.pop()
        self.num_pending = 0

    def append(self, token_id: int, logprobs: LogprobRef | None = None) -> int:
        """Accept one sampled token. Steps, in order:
        1. the grammar consumes it (a rejected token fails the sequence and is dropped);
        2. tokens the grammar now forces are appended without sampling (fast-forward);
        3. token stop rules: stop tokens, EOS, max_tokens, max_model_len, a finished grammar;
        4. record the sampled token's logprobs (forced tokens get theirs when they are computed,
           in the next step) and detokenize the new tokens;
        5. stop strings, matched across token boundaries.
        Returns the number of tokens appended (0 after a rejected token, 1 + the forced ones).
        A pending token (`add_pending`) is replaced."""
        if self.num_pending:
            self._drop_pending()
        self.token_ids.append(token_id)
        if self.matcher is None:  # most rows: one new token, no grammar
            could_stop = token_id in self.stop_ids or len(self.token_ids) >= self.max_num_tokens
            if could_stop and not self.is_finishing:
                self._apply_token_stop_rules(False)
            if logprobs is not None:
                self._add_logprobs(logprobs)
            if self.text_offsets is not None:
                self.text_offsets.append(len(self.text))  # where this token's text starts
            self._append_text(self.detokenizer.update_one(token_id))
            return 1
        new_tokens, grammar_done = self._advance_grammar()
        if not self.is_finishing:
            self._apply_token_stop_rules(grammar_done)
        if logprobs is not None and new_tokens:
            self._add_logprobs(logprobs)
        if self.text_offsets is None:
            self._append_text(self.detokenizer.update(new_tokens))
        else:
            self._append_text(self._detokenize_each(new_tokens, self.text_offsets))
        return len(new_tokens)

    def _advance_grammar(self) -> tuple[list[int], bool]:
        """Feed the sampled token to the matcher, then append the tokens the grammar forces (whose
        logprobs, when wanted, the next step computes). Returns the new output tokens and whether
        the grammar is complete."""
        matcher = self.matcher
        assert matcher is not None
        if not matcher.consume(self.token_ids[-1:]) or matcher.error is not None:
            self.token_ids.pop()
            self.finish(FinishReason.ERROR, error=matcher.error or "the grammar rejected the sampled token")
            return [], False
        new_tokens = self.token_ids[-1:]
        finished = matcher.is_finished
        if finished or not self.params.fast_forward:
            return new_tokens, finished
        forced = matcher.forced_tokens()
        if forced:
            forced = forced[: self._room_left()]
        if not forced:  # most steps of most grammars
            return new_tokens, False
        self.token_ids.extend(forced)
        new_tokens += forced
        if self.logprobs is not None:
            self.num_pending_forced = len(forced)
        if not matcher.consume(forced) or matcher.error is not None:
            self.finish(FinishReason.ERROR, error=matcher.error or "the grammar rejected a forced token")
            return new_tokens, False
        return new_tokens, matcher.is_finished

    def _room_left(self) -> int:
        room = self.limits.max_model_len - self.num_tokens
        if self.params.max_tokens is not None:
            room = min(room, self.params.max_tokens - self.num_output_tokens)
        return max(room, 0)

    def _apply_token_stop_rules(self, grammar_done: bool) -> None:
        token_ids = self.token_ids
        num_tokens = len(token_ids)
        last = token_ids[-1]
        if last in self.stop_ids:
            num_output = num_tokens - len(self.prompt_token_ids)
            if num_output >= self.params.min_tokens:
                stop_tokens = self.params.stop_token_ids
                return self.finish(FinishReason.STOP, stop_reason=last if last in stop_tokens else None)  # type: ignore[operator]
        if num_tokens >= self.max_num_tokens:
            return self.finish(FinishReason.LENGTH)
        if grammar_done:
            return self.finish(FinishReason.STOP)
        return None

    def _append_text(self, new_text: str) -> None:
        """Add the text of the new tokens; flush the detokenizer at a finish; stop strings."""
        if self.is_finishing:
            new_text += self.detokenizer.flush()
        if not new_text:
            return
        # O(new text): with the attribute dropped first, the local is the string's only reference
        # and CPython extends it in place (`self.text += new_text` copies all the text so far).
        text, self.text = self.text, ""
        text += new_text
        self.text = text
        if not self.stop_matcher.stops:
            return
        match = self.stop_matcher.check(self.text, len(new_text))
        if match is None or self.finish_reason == FinishReason.ERROR:
            return
        self.text = match.text
        self.finish(FinishReason.STOP, stop_reason=match.stop)  # also over LENGTH on the same token

    def _detokenize_each(self, new_tokens: list[int], offsets: list[int]) -> str:
        """The new tokens' text, recording where each token's text starts (for logprobs)."""
        if len(new_tokens) == 1:
            offsets.append(len(self.text))
            return self.detokenizer.update_one(new_tokens[0])
        parts, end = [], len(self.text)
        for token in new_tokens:
            offsets.append(end)
            parts.append(self.detokenizer.update([token]))
            end += len(parts[-1])
        return "".join(parts)

    def _add_logprobs(self, item: LogprobRef, forced: bool = False) -> None:
        """Record one position's logprobs: a reference to its row, made a `PositionLogprobs` only
        when an output's logprobs are read (`weft.logprob_records`). A sampled row's extra value is
        the log of the mass the constraint allowed; a forced token was the only one fast-forward
        allowed, so that mass is its own probability."""
        if self.logprobs is None or self.cumulative_logprob is None:
            return
        self.logprobs.append(item)
        if self.constraint_logmass is not None:
            constrained = self.params.structured is not None
            logmass = item.logprob if forced else item.extra
            self.constraint_logmass.append(logmass if constrained else 0.0)
        if self.forced is not None:
            self.forced.append(forced)
        self.cumulative_logprob += item.logprob

    # ---- output -----------------------------------------------------------------------------

    def completion(self, kind: OutputKind) -> CompletionOutput:
        """The completion so far (CUMULATIVE/FINAL_ONLY) or what is new since the last call (DELTA)."""
        sent = self.sent
        if kind is _DELTA and self.logprobs is None:
            return self._plain_delta(sent)
        ready, visible = self._ready()
        first = len(self.prompt_token_ids)
        logmass, offsets, forced = self.constraint_logmass, self.text_offsets, self.forced
        if kind is _DELTA:  # O(new tokens), not O(all of them)
            text = self.text[sent.num_chars : visible]
            token_ids = self.token_ids[first + sent.num_tokens : first + ready]
            logmass = None if logmass is None else logmass[sent.num_logprobs :]
            offsets = None if offsets is None else offsets[sent.num_logprobs : ready]
            forced = None if forced is None else forced[sent.num_logprobs :]
        else:  # copies of the lists that keep growing (O(n) per step)
            text = self.text[:visible]
            token_ids = self.token_ids[first : first + ready]
            offsets = None if offsets is None else offsets[:ready]
            logmass = None if logmass is None else list(logmass)
            forced = None if forced is None else list(forced)
        logprobs = self._lazy_logprobs(sent.num_logprobs if kind is _DELTA else 0)
        sent.num_chars, sent.num_tokens = visible, ready
        sent.num_logprobs = len(self.logprobs or [])
        return CompletionOutput(  # positional: a dozen keywords cost 4x as much, once per row per step
            self.index,
            text,
            token_ids,  # a fresh slice already
            self.finish_reason.value if self.finish_reason else None,
            self.stop_reason,
            self.cumulative_logprob,
            logprobs,  # built when read
            self.error,
            logmass,  # fresh slices or copies, from above
            offsets,
            forced,
        )

    def _lazy_logprobs(self, start: int) -> LazyPositions | None:
        """Positions `start..` of the logprobs so far, for an output that builds them when read."""
        refs = self.logprobs
        if refs is None:
            return None
        texts = self.detokenizer.tokenizer.token_texts
        return LazyPositions(refs, start, len(refs), self.params.logprobs or 0, texts)

    def _plain_delta(self, sent: OutputCursor) -> CompletionOutput:
        """`completion(DELTA)` of a sequence without logprobs: a server's stream, every step."""
        first = len(self.prompt_token_ids)
        ready, visible = self._ready()
        text = self.text[sent.num_chars : visible]
        token_ids = self.token_ids[first + sent.num_tokens : first + ready]
        sent.num_chars, sent.num_tokens = visible, ready
        reason = self.finish_reason
        return CompletionOutput(
            self.index, text, token_ids, reason.value if reason else None, self.stop_reason,
            self.cumulative_logprob, None, self.error, None, None, None,
        )  # fmt: skip

    def _ready(self) -> tuple[int, int]:
        """How many output tokens and characters can be handed out. While stop strings may still
        match, text that could be the start of one is held back; and so are forced tokens whose
        logprobs the next step computes, with their text."""
        if self.status >= FIRST_FINISHED or not (self.stop_matcher.holdback or self.num_pending_forced):
            return len(self.token_ids) - len(self.prompt_token_ids), len(self.text)
        sent = self.sent
        visible = max(sent.num_chars, len(self.text) - self.stop_matcher.holdback)
        ready = self.num_output_tokens
        if self.num_pending_forced and self.text_offsets is not None:
            ready -= self.num_pending_forced
            visible = min(visible, max(sent.num_chars, self.text_offsets[ready]))
        return ready, visible
