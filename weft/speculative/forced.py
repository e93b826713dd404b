"""Drafts that run on through what the grammar forces.

Under a grammar a guess often ends where the grammar takes over: a JSON value's closing quote is
followed by `, "age": ` (forced, appended without sampling) and then the next value, which the
prompt may state too. A draft cut at the guess leaves the forced tokens to the next step and the
next value to the step after it. Instead the draft goes on: the forced tokens after the guess (the
matcher, advanced over the guess and rolled back), then a guess after them from the drafter
(`Drafter.propose_after`, which reads nothing into its state), and so on while guesses come and
`num_speculative_tokens` allows; forced tokens count against the room left, not against the guesses.
Forced tokens that no guess follows stay out of the draft: after the draft's last token they are
appended anyway, and the next step's draft starts where a guess can (at a value's opening).

Verification: a forced position gets no sampling row (`ScheduledSequence.rowless`: its token is
known once the guesses before it are kept), and `Speculation.verify` keeps the forced
tokens that `Sequence.append` appends after an accepted guess where the draft holds them. Only a
sequence without logprobs drafts so (forced tokens wanting logprobs are computed in a step of
their own).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from weft.structured.grammar import GrammarMatcher

# (the sequence's tokens, the draft so far, how many more guesses) -> guesses after the draft
ProposeAfter = Callable[[Sequence[int], list[int], int], list[int]]


def through_forced(
    matcher: GrammarMatcher,
    propose_after: ProposeAfter | None,
    token_ids: Sequence[int],
    guessed: list[int],
    num_guesses: int,
    room: int,
    rate: float = 1.0,
    share: float = 0.0,
) -> tuple[list[int], list[int]]:
    """`guessed` (which the grammar accepts) followed by what the grammar forces after it and a
    guess after that, as long as guesses come and it pays (`_pays`, from the chance `rate` that a
    guess is accepted and a token's cost `share` of a row's step): at most `num_guesses` guesses
    in all and `room` tokens. Forced tokens that no guess follows are left out (`Sequence.append`
    appends them after the token sampled at the draft's end, as without a draft). Returns the
    draft and the positions of the forced tokens in it; the matcher is left as it was."""
    draft, forced_at = list(guessed), list[int]()
    if propose_after is None:
        return draft, forced_at
    consumed = 0
    try:
        while len(draft) < room and len(draft) - len(forced_at) < num_guesses:
            if not matcher.consume(draft[consumed:]):
                break
            consumed = len(draft)
            forced = matcher.forced_tokens()
            left = min(num_guesses - (len(draft) - len(forced_at)), room - len(draft) - len(forced))
            if not forced or left <= 0:
                break
            more = propose_after(token_ids, draft + forced, left)
            if not more or not matcher.consume(forced):
                break
            consumed += len(forced)
            more = more[: matcher.validate(more)]
            if not more or not _pays(rate ** (len(draft) - len(forced_at)), len(forced) + len(more), share):
                break
            forced_at += range(len(draft), len(draft) + len(forced))
            draft += forced + more
    finally:
        matcher.rollback(consumed)
    return draft, forced_at


def _pays(reached: float, num_tokens: int, share: float) -> bool:
    """Whether `num_tokens` more (forced tokens and the guess after them) pay, where the draft so
    far is all accepted with chance `reached`: then they save about a step (the guess is drafted
    now, not a step later, and the forced tokens are computed now instead of then), else each is
    computed for nothing at `share` of a row's step."""
    return reached >= (1.0 - reached) * num_tokens * share
