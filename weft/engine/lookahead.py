"""Lookahead (async scheduling): schedule and launch step N+1 before step N's tokens are read back.

On a GPU a decode step's forward takes 1-4 ms and the host's work around it (scheduling, inputs,
reading the tokens back, appending them, detokenizing, outputs) about as long; done in turn, the
device waits for the host and the host for the device. With lookahead, a step whose rows need
nothing from their sampled tokens but the tokens themselves stays in flight: each sampling
sequence gets `PENDING_TOKEN` in place of its token (`Sequence.add_pending`), the next step is
scheduled and launched with those inputs taken from the device (`InFlightTokens`), and only then
is the step in flight read back and its tokens appended, while the device computes the next one
(the idea of vLLM v1's async scheduling and SGLang's overlap scheduler).

What it costs: a sequence that finishes on a token's value (EOS, a stop string or token) is
computed one step too many, and that row's token is dropped; one that reaches its length is not
scheduled again (the host knows its last token is pending), and a step whose every row ends so is
read back at once. What it keeps: every output is the same, token for token,
as with the step done in turn (a row's tokens do not depend on the rest of its batch), and each
step still reads the device back once. Steps that need their tokens on the host before the next
is scheduled are done in turn: grammar rows (the mask of the next step), penalties and logits
processors (the token history), beams and fanouts (their group's policy decides), and rows whose
known tokens' logprobs ride on the step (prompt logprobs, forced tokens).
"""

from __future__ import annotations

from collections.abc import Mapping

from weft.engine.group import SequenceGroup
from weft.engine.launch import Launched
from weft.engine.runner import InFlightTokens
from weft.engine.sequence import FIRST_FINISHED


def can_stay_in_flight(launched: Launched, groups: Mapping[str, SequenceGroup]) -> bool:
    """Whether the next step can be scheduled before this one's tokens are on the host: no row needs
    its token on the host first, and some row still runs after it (its sequence not finished by the
    step read back before it, and its sampled token not its last for length)."""
    layout = launched.layout
    if layout.fanouts or launched.spans:
        return False
    running = False
    for seq in layout.sequences:
        params = seq.params
        if (
            seq.matcher is not None
            or seq.defers_sampling
            or seq.num_pending_forced
            or seq.pending_finish is not None
            or params.needs_penalties
            or params.logits_processors
        ):
            return False
        group = groups.get(seq.request_id) if seq.request_id is not None else None
        if group is None or not group.policy.allows_lookahead():
            return False
        running = running or (seq.status < FIRST_FINISHED and seq.tokens_left > 1)
    return running


def commit(launched: Launched) -> InFlightTokens:
    """Leave `launched` in flight (its tokens counted as computed, `Scheduler.advance`): every
    sampling sequence still running holds a pending token, taken from `launched.tokens` by the next
    step."""
    rows = {}
    layout = launched.layout
    for item, row in zip(layout.sched.scheduled, layout.first_rows, strict=True):
        seq = item.seq
        if row >= 0 and not seq.is_finished:
            seq.add_pending()
            rows[seq.seq_id] = row
    launched.in_flight = InFlightTokens(launched.tokens, rows)
    return launched.in_flight
