"""One stream of tokens being generated: its tokens, progress, status and grammar matcher.

A `Sequence` is the single owner of everything that belongs to one stream; two parts of it are
objects of their own: its text (`TextState`: detokenizer, stop strings, text, what was handed out)
and, with logprobs, its per-position outputs (`PositionOutputs`). `append()` is the one place where
a sampled token is accepted; `fork()` copies the whole state at any depth (the grammar matcher
forked from its current state, never recompiled or replayed). The KV blocks of a sequence belong
to the KV manager, keyed by `seq_id`; the scheduler releases them when the sequence finishes.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from enum import IntEnum, StrEnum

from weft.engine.positions import PositionOutputs
from weft.engine.text_state import TextState
from weft.logprob_records import LogprobRef
from weft.outputs import CompletionOutput, PositionLogprobs
from weft.params import OutputKind, SamplingParams
from weft.structured.grammar import GrammarMatcher
from weft.tokenizer import Tokenizer


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


@dataclass(frozen=True, slots=True)
class StopRules:
    """The token stop rules of one sequence, resolved once from its params and its engine's limits
    (`StopRules.of`): the ids that end it once it has min_tokens (stop tokens, and EOS unless
    ignored), and the total token count at which it stops for length (max_tokens after the prompt,
    or max_model_len)."""

    limits: SequenceLimits
    stop_ids: frozenset[int]
    max_num_tokens: int

    @classmethod
    def of(cls, params: SamplingParams, limits: SequenceLimits, num_prompt_tokens: int) -> StopRules:
        stop_ids = frozenset(params.stop_token_ids) | (
            frozenset() if params.ignore_eos else limits.eos_token_ids
        )
        max_num_tokens = limits.max_model_len
        if params.max_tokens is not None:
            max_num_tokens = min(max_num_tokens, num_prompt_tokens + params.max_tokens)
        return cls(limits, stop_ids, max_num_tokens)


@dataclass(frozen=True, slots=True)
class Finish:
    """How a sequence finished: its reason, the stop token or string that ended it, and for an
    error the message."""

    reason: FinishReason
    stop_reason: str | int | None = None
    error: str | None = None


@dataclass(slots=True)
class PolicyRole:
    """What a group policy that drives its sequences asks of one of them. Beam search chooses the
    tokens itself (`defers_sampling`): a step that computes the sequence leaves its top logprobs in
    `candidates` and parks it instead of appending a sampled token. SMC weighs a text's end too
    (`samples_end`): a finished grammar does not end the sequence, which then samples its
    end-of-sequence token, the one token the grammar allows there."""

    defers_sampling: bool = False
    samples_end: bool = False
    candidates: LogprobRef | None = None

    def fork(self) -> PolicyRole:
        return PolicyRole(self.defers_sampling, self.samples_end)


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
    stops: StopRules
    seed: int  # the request's seed (+ index), or one drawn for it: randomness is keyed by (seed, position)
    text_state: TextState
    token_ids: list[int]
    request_id: str | None = None  # its request's id (its group's, weft/engine/group.py); None: none
    matcher: GrammarMatcher | None = None
    num_computed_tokens: int = 0
    status: SequenceStatus = SequenceStatus.WAITING
    outcome: Finish | None = None  # set when it finishes
    # per output position its logprob record, text offset and forced flag (with logprobs, or a ranking
    # that needs them)
    position_outputs: PositionOutputs | None = None
    # Three things pending, each its own: the token a step in flight samples (`num_pending`, below);
    # with logprobs, tokens the grammar forced, which the next step computes with their logprobs
    # (the last `num_pending_forced` tokens lack them); and a finish decided meanwhile, which waits
    # in `pending_finish` until they are computed (`Scheduler.accept` applies it).
    num_pending_forced: int = 0
    pending_finish: tuple[FinishReason, str | int | None] | None = None
    prompt_logprobs: list[PositionLogprobs | None] | None = None  # [None] + one per prompt token
    num_cached_prompt_tokens: int = 0
    role: PolicyRole | None = None  # set by a policy that drives it (beam search, SMC)
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
        return cls(
            seq_id=seq_id,
            index=0,
            params=params,
            prompt_token_ids=prompt_token_ids,
            stops=StopRules.of(params, limits, len(prompt_token_ids)),
            seed=seed,
            text_state=TextState.create(tokenizer, prompt_token_ids, params),
            token_ids=list(prompt_token_ids),
            position_outputs=None if params.logprobs is None else PositionOutputs(),
            prompt_logprobs=[None] if params.prompt_logprobs is not None else None,
        )

    # ---- counts -----------------------------------------------------------------------------

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def tokens_left(self) -> int:
        """Tokens this sequence may still append before it ends for length (`max_tokens` or
        `max_model_len`); a pending token counts as appended, so 0 with one pending means that
        token is its last."""
        return self.stops.max_num_tokens - len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - len(self.prompt_token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[len(self.prompt_token_ids) :]

    @property
    def eos_token_ids(self) -> frozenset[int]:
        return self.stops.limits.eos_token_ids

    @property
    def finish_reason(self) -> FinishReason | None:
        return None if self.outcome is None else self.outcome.reason

    @property
    def stop_reason(self) -> str | int | None:
        return None if self.outcome is None else self.outcome.stop_reason

    @property
    def error(self) -> str | None:
        return None if self.outcome is None else self.outcome.error

    @property
    def defers_sampling(self) -> bool:
        """Whether its policy chooses its tokens (`PolicyRole`)."""
        return self.role is not None and self.role.defers_sampling

    @property
    def is_finished(self) -> bool:
        return self.status >= FIRST_FINISHED

    @property
    def text(self) -> str:
        return self.text_state.text

    @property
    def cumulative_logprob(self) -> float | None:
        """The sum of the output tokens' logprobs, when they are tracked."""
        return None if self.position_outputs is None else self.position_outputs.cumulative_logprob

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
        texts = self.text_state.token_texts
        num_top = self.params.prompt_logprobs or 0
        for offset, item in enumerate(items):
            if first_token + offset != len(self.prompt_logprobs):
                continue
            self.prompt_logprobs.append(item.position(num_top, texts))

    def add_forced_logprobs(self, first_token: int, items: list[LogprobRef]) -> None:
        """The model's logprobs of forced tokens `first_token`, `first_token + 1`, ... (computed like
        prompt tokens; column 0 is the forced token). Tokens already recorded are skipped."""
        positions = self.position_outputs
        if positions is None:
            return
        constrained = self.params.structured is not None
        for offset, item in enumerate(items):
            if first_token + offset == self.num_tokens - self.num_pending_forced:
                positions.add(item, True, constrained)
                self.num_pending_forced -= 1

    # ---- the life cycle ---------------------------------------------------------------------

    def finish(
        self, reason: FinishReason, stop_reason: str | int | None = None, error: str | None = None
    ) -> None:
        """Mark the sequence finished and drop its matcher. Its KV blocks are released by the
        scheduler, which sees the status (`Scheduler.accept`, `Scheduler.finish`). A stop or a
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
        self.outcome = Finish(reason, stop_reason, error)
        self.matcher = None

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
        """Finish with an output chosen as a whole (exact choice selection), not decoded: its logprob
        is tracked (for the output's cumulative_logprob), its positions are not."""
        self.token_ids.extend(token_ids)
        self.text_state.text = text
        self.position_outputs = PositionOutputs(cumulative_logprob=cumulative_logprob)
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
            text_state=self.text_state.fork(),
            token_ids=list(self.token_ids),
            matcher=None if self.matcher is None else self.matcher.fork(),
            num_computed_tokens=0,
            status=SequenceStatus.WAITING,
            outcome=None,
            position_outputs=None if self.position_outputs is None else self.position_outputs.fork(),
            prompt_logprobs=None if self.prompt_logprobs is None else list(self.prompt_logprobs),
            role=None if self.role is None else self.role.fork(),
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
            could_stop = token_id in self.stops.stop_ids or self.tokens_left <= 0
            if could_stop and not self.is_finishing:
                self._apply_token_stop_rules(False)
            positions = self.position_outputs
            if positions is not None:
                if logprobs is not None:
                    positions.add(logprobs, False, self.params.structured is not None)
                positions.text_offsets.append(len(self.text_state.text))  # where its text starts
            stopped = could_stop and self._stopped_by_token()
            self._append_text("" if stopped else self.text_state.decode_one(token_id))
            return 1
        new_tokens, grammar_done = self._advance_grammar()
        if not self.is_finishing:
            self._apply_token_stop_rules(grammar_done)
        positions = self.position_outputs
        shown = new_tokens[:-1] if new_tokens and self._stopped_by_token() else new_tokens
        if positions is None:
            self._append_text(self.text_state.decode(shown))
            return len(new_tokens)
        if logprobs is not None and new_tokens:
            positions.add(logprobs, False, self.params.structured is not None)
        self._append_text(self.text_state.decode_each(shown, positions.text_offsets))
        positions.text_offsets.extend([len(self.text_state.text)] * (len(new_tokens) - len(shown)))
        return len(new_tokens)

    def _stopped_by_token(self) -> bool:
        """Whether the last token finished the sequence as a stop token (EOS, end of turn, a stop
        token id): its text is not part of the output (as vLLM; `include_stop_str_in_output` keeps
        it), so that no end-of-turn marker reaches a reply even where special tokens are kept."""
        return (
            self.finish_reason == FinishReason.STOP
            and self.token_ids[-1] in self.stops.stop_ids
            and not self.params.include_stop_str_in_output
        )

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
        if self.position_outputs is not None:
            self.num_pending_forced = len(forced)
        if not matcher.consume(forced) or matcher.error is not None:
            self.finish(FinishReason.ERROR, error=matcher.error or "the grammar rejected a forced token")
            return new_tokens, False
        return new_tokens, matcher.is_finished

    def _room_left(self) -> int:
        return max(self.tokens_left, 0)  # max_tokens after the prompt, or max_model_len

    def _apply_token_stop_rules(self, grammar_done: bool) -> None:
        token_ids = self.token_ids
        num_tokens = len(token_ids)
        last = token_ids[-1]
        stops = self.stops
        if last in stops.stop_ids:
            num_output = num_tokens - len(self.prompt_token_ids)
            if num_output >= self.params.min_tokens:
                stop_tokens = self.params.stop_token_ids
                return self.finish(FinishReason.STOP, stop_reason=last if last in stop_tokens else None)
        if num_tokens >= stops.max_num_tokens:
            return self.finish(FinishReason.LENGTH)
        if grammar_done and not (self.role is not None and self.role.samples_end):
            return self.finish(FinishReason.STOP)
        return None

    def _append_text(self, new_text: str) -> None:
        """Add the text of the new tokens (flushing the detokenizer at a finish); a stop string
        that now matches cuts the text there and finishes the sequence (also over a LENGTH finish
        on the same token, never over an error)."""
        match = self.text_state.extend(new_text, self.is_finishing)
        if match is None or self.finish_reason == FinishReason.ERROR:
            return
        self.text_state.text = match.text
        self.finish(FinishReason.STOP, stop_reason=match.stop)

    # ---- output -----------------------------------------------------------------------------

    def completion(self, kind: OutputKind) -> CompletionOutput:
        """The completion so far (CUMULATIVE/FINAL_ONLY) or what is new since the last call (DELTA)."""
        state = self.text_state
        sent = state.sent
        positions = self.position_outputs
        delta = kind is _DELTA
        ready, visible = self._ready()
        first = len(self.prompt_token_ids)
        start_token, start_char = (sent.num_tokens, sent.num_chars) if delta else (0, 0)
        text = state.text[start_char:visible]
        token_ids = self.token_ids[first + start_token : first + ready]
        outcome = self.outcome
        reason, stop_reason, error = (None, None, None) if outcome is None else _reported(outcome)
        sent.num_chars, sent.num_tokens = visible, ready
        if positions is None:  # a server's stream without logprobs, every step
            return CompletionOutput(
                self.index, text, token_ids, reason, stop_reason, None, None, error, None, None, None
            )  # fmt: skip
        # O(new positions) for a DELTA; copies of the lists that keep growing otherwise
        start = sent.num_logprobs if delta else 0
        num_top = self.params.logprobs or 0
        logprobs, logmass, offsets, forced = positions.span(start, ready, num_top, state.token_texts)
        sent.num_logprobs = len(positions.records)
        return CompletionOutput(  # positional: a dozen keywords cost 4x as much, once per row per step
            self.index, text, token_ids, reason, stop_reason,
            positions.cumulative_logprob, logprobs, error, logmass, offsets, forced,
        )  # fmt: skip

    def _ready(self) -> tuple[int, int]:
        """How many output tokens and characters can be handed out. While stop strings may still
        match, text that could be the start of one is held back; and so are forced tokens whose
        logprobs the next step computes, with their text."""
        state = self.text_state
        holding = state.stop_matcher.holdback > 0
        if self.status >= FIRST_FINISHED or not (holding or self.num_pending_forced):
            return len(self.token_ids) - len(self.prompt_token_ids), len(state.text)
        visible = state.ready_chars()
        ready = self.num_output_tokens
        if self.num_pending_forced and self.position_outputs is not None:
            ready -= self.num_pending_forced
            visible = min(visible, max(state.sent.num_chars, self.position_outputs.text_offsets[ready]))
        return ready, visible


def _reported(outcome: Finish) -> tuple[str, str | int | None, str | None]:
    """(finish reason, stop reason, error) as a completion reports them."""
    return outcome.reason.value, outcome.stop_reason, outcome.error
