"""Exact choice selection as a group policy: the `n` most probable options, scored, not decoded.

With `choice_selection="exact"` a request's options are scored exactly (`weft.engine.scoring`: the
total logprob of each option's tokens after the prompt, one pass over their token trie) when the
policy starts; its sequences finish at once with the `n` best options, best first, and never run.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from weft.engine.group import NO_UPDATE, GroupUpdate, SequenceGroup, Spawner, check_logprob_limits
from weft.engine.sequence import FinishReason, Sequence
from weft.outputs import ChoiceScore, RequestOutput
from weft.params import SamplingParams

# Scores options after a prompt: (prompt text or None, prompt ids, options) -> one score each.
OptionScorer = Callable[[str | None, list[int], list[str]], list[ChoiceScore]]


@dataclass(slots=True)
class ExactChoice:
    num_returned: int
    score: OptionScorer

    def validate(self, params: SamplingParams, vocab_size: int, max_logprobs: int) -> None:
        choices = params.choice or ()
        if params.n > len(choices):
            raise ValueError(
                f"SamplingParams.n={params.n} asks for more options than the {len(choices)} choices given"
            )
        if params.best_of is not None and params.best_of > params.n:
            raise ValueError("SamplingParams.best_of does not apply to choice_selection='exact'; use n")
        if params.logprobs is not None:
            raise ValueError(
                "SamplingParams.logprobs is not available with choice_selection='exact'; each option's "
                "total logprob is its cumulative_logprob (LLM.score gives each token's)"
            )
        check_logprob_limits(params, max_logprobs)

    def start(self, group: SequenceGroup, first: Sequence, spawner: Spawner) -> None:
        """Score the options and finish with the `num_returned` most probable, best first."""
        try:
            scores = self.score(group.prompt, group.prompt_token_ids, list(group.params.choice or ()))
        except ValueError as exc:
            first.finish(FinishReason.ERROR, error=str(exc))
            return
        ranked = sorted(scores, key=lambda s: -s.logprob)[: self.num_returned]
        chosen = [first] + [spawner.fork(first, i) for i in range(1, len(ranked))]
        for seq, score in zip(chosen, ranked, strict=True):
            seq.complete_with(score.token_ids, score.text, score.logprob)
        group.add(chosen[1:])

    def allows_lookahead(self) -> bool:
        return False  # never scheduled

    def after_step(self, group: SequenceGroup) -> GroupUpdate:
        return NO_UPDATE

    def reported(self, group: SequenceGroup, finished: bool) -> list[Sequence] | None:
        return group.sequences

    def take_fanout(self, seq: Sequence, limit: int) -> list[Sequence]:
        return []

    def annotate(self, output: RequestOutput) -> None:
        pass
