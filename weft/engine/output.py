"""Per-sequence output state: incremental text, stop strings, logprobs; and `RequestOutput`s."""

from __future__ import annotations

from dataclasses import dataclass, field

from weft.outputs import CompletionOutput, Logprob, PositionLogprobs, RequestOutput
from weft.params import OutputKind
from weft.request import Request
from weft.tokenizer import IncrementalDetokenizer, StopMatch, StopStringMatcher, Tokenizer


@dataclass(slots=True)
class TokenLogprobs:
    """One sampled position: ids [k+1] (sampled first), their logprobs, the sampled token's rank."""

    token_ids: list[int]
    logprobs: list[float]
    rank: int


@dataclass(slots=True)
class SequenceOutput:
    """Output state of one sequence (one of a request's n samples)."""

    request: Request
    index: int
    detokenizer: IncrementalDetokenizer
    stop_matcher: StopStringMatcher
    text: str = ""
    cumulative_logprob: float | None = None
    logprobs: list[PositionLogprobs] | None = None
    num_sent_chars: int = 0
    num_sent_tokens: int = 0
    num_sent_logprobs: int = 0

    @classmethod
    def create(cls, request: Request, index: int, tokenizer: Tokenizer) -> SequenceOutput:
        params = request.params
        return cls(
            request=request,
            index=index,
            detokenizer=IncrementalDetokenizer(tokenizer, request.token_ids, params.skip_special_tokens),
            stop_matcher=StopStringMatcher(params.stop_strings, params.include_stop_str_in_output),
            cumulative_logprob=0.0 if params.logprobs is not None else None,
            logprobs=[] if params.logprobs is not None else None,
        )

    def append(
        self, new_token_ids: list[int], token_logprobs: list[TokenLogprobs], tokenizer: Tokenizer
    ) -> StopMatch | None:
        """Add newly generated tokens; returns the stop string match, if one completed."""
        before = len(self.text)
        self.text += self.detokenizer.update(new_token_ids)
        if self.request.is_finished:
            self.text += self.detokenizer.flush()
        for item in token_logprobs:
            self._add_logprobs(item, tokenizer)
        match = self.stop_matcher.check(self.text, len(self.text) - before)
        if match is not None:
            self.text = match.text
        return match

    def _add_logprobs(self, item: TokenLogprobs, tokenizer: Tokenizer) -> None:
        if self.logprobs is None or self.cumulative_logprob is None:
            return
        num_top = self.request.params.logprobs or 0
        chosen_id, chosen_lp = item.token_ids[0], item.logprobs[0]
        position: PositionLogprobs = {
            chosen_id: Logprob(chosen_lp, item.rank, tokenizer.decode([chosen_id], False))
        }
        for rank, (tid, lp) in enumerate(
            zip(item.token_ids[1 : 1 + num_top], item.logprobs[1 : 1 + num_top], strict=True), start=1
        ):
            position.setdefault(tid, Logprob(lp, rank, tokenizer.decode([tid], False)))
        self.logprobs.append(position)
        self.cumulative_logprob += chosen_lp

    def completion(self, kind: OutputKind) -> CompletionOutput:
        """The completion so far (CUMULATIVE/FINAL_ONLY) or what is new since the last call (DELTA)."""
        request = self.request
        finished = request.is_finished
        # While stop strings may still match, hold back text that could be the start of one.
        visible = (
            len(self.text)
            if finished
            else max(self.num_sent_chars, len(self.text) - self.stop_matcher.holdback)
        )
        token_ids = request.output_token_ids
        logprobs = self.logprobs
        if kind == OutputKind.DELTA:
            text = self.text[self.num_sent_chars : visible]
            token_ids = token_ids[self.num_sent_tokens :]
            logprobs = None if logprobs is None else logprobs[self.num_sent_logprobs :]
        else:
            text = self.text[:visible]
        self.num_sent_chars, self.num_sent_tokens = visible, request.num_output_tokens
        self.num_sent_logprobs = len(self.logprobs or [])
        return CompletionOutput(
            index=self.index,
            text=text,
            token_ids=list(token_ids),
            finish_reason=request.finish_reason.value if request.finish_reason else None,
            stop_reason=request.stop_reason,
            cumulative_logprob=self.cumulative_logprob,
            logprobs=logprobs,
            error=request.error,
        )


@dataclass(slots=True)
class RequestState:
    """A user request: its prompt and its n sequences."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    kind: OutputKind
    num_samples: int
    sequences: list[SequenceOutput] = field(default_factory=list)

    @property
    def finished(self) -> bool:
        return len(self.sequences) == self.num_samples and all(s.request.is_finished for s in self.sequences)

    def make_output(self) -> RequestOutput | None:
        finished = self.finished
        if self.kind == OutputKind.FINAL_ONLY and not finished:
            return None
        return RequestOutput(
            request_id=self.request_id,
            prompt=self.prompt,
            prompt_token_ids=self.prompt_token_ids,
            outputs=[s.completion(self.kind) for s in self.sequences],
            finished=finished,
            num_cached_tokens=self.sequences[0].request.num_cached_prompt_tokens if self.sequences else 0,
        )
