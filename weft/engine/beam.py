"""Beam search as a group policy: beams are sequences that fork, park and are pruned.

Each step computes every live beam once (beams of many requests batch together, and with any
other request). The sampler leaves each beam's top-K candidate tokens with their logprobs (MASKED
mode: the model's logprobs where the constraint allows the token) and the scheduler parks it.
When all of a group's live beams have their candidates, `BeamSearch.after_step` chooses, exactly as
transformers' beam search does:

1. the K = max(2, 1 + number of EOS ids) * width best continuations over all beams, by
   cumulative logprob;
2. those of the first `width` that end the sequence (EOS, a stop token, max_tokens) become
   finished hypotheses, scored `cumulative / generated_length ** length_penalty`, keeping the best
   `width` (unless `early_stopping` or the heuristic says no finished one can improve any more);
3. the best `width` continuations that do not end become the next beams.

A beam continued once takes the token itself; a beam continued k times forks k - 1 children first
(sharing its blocks, its grammar matcher forked from its state, never replayed); a beam not
continued is pruned and frees its blocks. Hypotheses are forks that never run. A beam that
finishes when its token is appended (a stop string, a completed grammar) is scored as a hypothesis
at once, so that step may continue fewer than `width` beams.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import NamedTuple

from weft.engine.group import GroupUpdate, SequenceGroup, Spawner
from weft.engine.sequence import FinishReason, PolicyRole, Sequence
from weft.outputs import RequestOutput
from weft.params import BeamSearchParams, SamplingParams


def beam_score(cumulative_logprob: float, num_generated: int, length_penalty: float) -> float:
    """transformers' hypothesis score: the logprob sum over `generated length ** length_penalty`."""
    return cumulative_logprob / (max(num_generated, 1) ** length_penalty)


def num_candidates(beam_width: int, num_eos_ids: int) -> int:
    """How many continuations a step keeps (transformers: enough to continue `beam_width` beams
    even when each EOS id takes one of the best)."""
    return max(2, 1 + num_eos_ids) * beam_width


class Candidate(NamedTuple):
    score: float  # the beam's cumulative logprob + this token's
    beam: int  # index of the parent in the live beams
    rank: int  # the token's rank among its parent's candidates (ties keep transformers' order)
    token_id: int
    ends: bool  # appending it ends the sequence (EOS, stop token, max_tokens, max_model_len)


@dataclass(slots=True)
class Hypothesis:
    score: float
    order: int  # insertion order, to break ties like a stable sort
    seq: Sequence


@dataclass(slots=True)
class BeamSearch:
    params: BeamSearchParams
    eos_token_ids: frozenset[int]
    max_model_len: int
    live: list[Sequence] = field(default_factory=list)  # best first
    finished: list[Hypothesis] = field(default_factory=list)  # best first, at most beam_width
    num_generated: int = 0
    improvable: bool = True  # transformers' early-stop heuristic: finished ones can still improve
    done: bool = False
    spawner: Spawner | None = None
    failed: list[Sequence] = field(default_factory=list)  # beams that failed as they ran
    _order: int = 0

    @property
    def width(self) -> int:
        return self.params.beam_width

    @property
    def stops_early(self) -> bool:
        """early_stopping=True; and width 1, which is greedy decoding (as in transformers)."""
        return self.params.early_stopping is True or self.width == 1

    @property
    def num_candidates(self) -> int:
        return num_candidates(self.width, 0 if self.params.ignore_eos else len(self.eos_token_ids))

    def validate(self, params: SamplingParams, vocab_size: int, max_logprobs: int) -> None:
        if params.logprobs is not None and params.logprobs > vocab_size:
            raise ValueError(f"beam_width is too large for a vocabulary of {vocab_size} tokens")

    def allows_lookahead(self) -> bool:
        return False  # every step's candidates decide the next beams

    def start(self, group: SequenceGroup, first: Sequence, spawner: Spawner) -> None:
        self.spawner = spawner
        first.role = PolicyRole(defers_sampling=True)
        self.live = [first]

    def reported(self, group: SequenceGroup, finished: bool) -> list[Sequence] | None:
        return group.sequences if finished else None

    def take_fanout(self, seq: Sequence, limit: int) -> list[Sequence]:
        return []

    def annotate(self, output: RequestOutput) -> None:
        pass

    def after_step(self, group: SequenceGroup) -> GroupUpdate:
        if self.done:
            return GroupUpdate()
        self.failed += [s for s in self.live if s.is_finished]  # e.g. non-finite logits
        self.live = [s for s in self.live if not s.is_finished]
        if any(_role(s).candidates is None for s in self.live):
            return GroupUpdate()  # some beams have not run yet this round
        candidates = self._candidates() if self.live else []
        self.num_generated += 1
        self._add_finished([(c.score, self._spawn(c)) for c in candidates[: self.width] if c.ends])
        update = self._extend(group, [c for c in candidates if not c.ends][: self.width])
        self._update_heuristic()
        full = len(self.finished) == self.width
        if (
            not self.improvable
            or (full and self.stops_early)
            or all(c.ends for c in candidates)
            or not self.live
        ):
            return self._finish(group, update)
        return update

    def _candidates(self) -> list[Candidate]:
        """The K best continuations over all live beams."""
        out: list[Candidate] = []
        for b, beam in enumerate(self.live):
            role = _role(beam)
            found, cumulative = role.candidates, beam.cumulative_logprob
            assert found is not None and cumulative is not None
            role.candidates = None
            token_ids, logprobs, _ = found.lists()
            pairs = zip(token_ids[1:], logprobs[1:], strict=True)
            for rank, (token, logprob) in enumerate(pairs):
                if logprob > -math.inf:
                    out.append(Candidate(cumulative + logprob, b, rank, token, self._ends(beam, token)))
        out.sort(key=lambda c: (-c.score, c.beam, c.rank))
        return out[: self.num_candidates]

    def _ends(self, beam: Sequence, token: int) -> bool:
        params = self.params
        if token in params.stop_token_ids or (not params.ignore_eos and token in self.eos_token_ids):
            return True
        return self.num_generated + 1 >= params.max_tokens or beam.num_tokens + 1 >= self.max_model_len

    def _spawn(self, c: Candidate) -> Sequence:
        """A fork of the candidate's beam (in its state before this step's token) taking its token."""
        assert self.spawner is not None
        child = self.spawner.fork(self.live[c.beam], 0)
        child.append(c.token_id)
        _score(child, c.score)
        return child

    def _add_finished(self, hypotheses: list[tuple[float, Sequence]]) -> None:
        """Keep the best `width` finished hypotheses, unless the finished set may no longer change
        (early_stopping with `width` finished, or the heuristic)."""
        full = len(self.finished) == self.width
        if not hypotheses or (full and self.stops_early) or not self.improvable:
            return
        for cumulative, seq in hypotheses:
            self._order += 1
            score = beam_score(cumulative, self.num_generated, self.params.length_penalty)
            self.finished.append(Hypothesis(score, self._order, seq))
        self.finished.sort(key=lambda h: (-h.score, h.order))
        del self.finished[self.width :]

    def _extend(self, group: SequenceGroup, continuing: list[Candidate]) -> GroupUpdate:
        """The next beams: a parent continued k times forks k - 1 children before it takes its
        own token; a parent not continued is pruned. A beam that finishes as its token is appended
        (a stop string, a completed grammar) is a finished hypothesis at once."""
        by_beam: dict[int, list[Candidate]] = {}
        for c in continuing:
            by_beam.setdefault(c.beam, []).append(c)
        update = GroupUpdate()
        taken: dict[Candidate, Sequence] = {}
        for b, beam in enumerate(self.live):
            mine = by_beam.get(b)
            if not mine:
                update.prunes.append(beam)
                continue
            for c in mine[1:]:
                taken[c] = self._spawn(c)
                update.forks.append((beam, taken[c]))
            beam.append(mine[0].token_id)
            _score(beam, mine[0].score)
            taken[mine[0]] = beam
            update.resumes.append(beam)
        ended = [seq for seq in taken.values() if seq.is_finished]
        self._add_finished([(seq.cumulative_logprob or 0.0, seq) for seq in ended])
        update.prunes.extend(ended)
        update.forks[:] = [(p, c) for p, c in update.forks if not c.is_finished]
        update.resumes[:] = [s for s in update.resumes if not s.is_finished]
        self.live = [taken[c] for c in continuing if not taken[c].is_finished]
        group.sequences = list(self.live)
        return update

    def _update_heuristic(self) -> None:
        """transformers' early-stop heuristic: once `width` hypotheses are finished, stop when the
        best running beam, scored at its current length (at max_tokens for early_stopping="never"
        with a positive length penalty), cannot beat the worst of them."""
        if len(self.finished) < self.width:
            return
        if not self.live:
            self.improvable = False
            return
        penalty = self.params.length_penalty
        never = self.params.early_stopping == "never" and penalty > 0.0
        length = self.params.max_tokens if never else self.num_generated
        best = beam_score(self.live[0].cumulative_logprob or 0.0, length, penalty)
        self.improvable = self.improvable and best > self.finished[-1].score

    def _finish(self, group: SequenceGroup, update: GroupUpdate) -> GroupUpdate:
        """Done: release every beam still running; the output is the finished hypotheses, best
        first (or, when none finished, why: a failed beam)."""
        self.done = True
        prunes = [*update.prunes, *update.resumes, *(child for _, child in update.forks), *self.live]
        self.live = []
        results = [h.seq for h in self.finished] or self.failed[:1]
        if not results:  # every candidate was excluded (-inf): report why, on a released beam
            results = prunes[:1]
            results[0].finish(FinishReason.ERROR, error="beam search found no token the constraint allows")
        for index, seq in enumerate(results):
            seq.index = index
        group.sequences = results
        return GroupUpdate(prunes=prunes)


def _score(beam: Sequence, cumulative_logprob: float) -> None:
    """A beam's tokens are chosen here, not sampled with logprobs: its sum is set here too."""
    assert beam.position_outputs is not None  # beams ask for their candidates' logprobs
    beam.position_outputs.cumulative_logprob = cumulative_logprob


def _role(beam: Sequence) -> PolicyRole:
    """A beam's part in the search (`start` gives the first one; forks copy it)."""
    assert beam.role is not None
    return beam.role
