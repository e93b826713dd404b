"""Sequential Monte Carlo over grammar-constrained particles: the policy of `SamplingParams.smc`.

Masking the logits to a grammar renormalizes at every step, so a prefix that leads mostly into
forbidden continuations is taken as often as if it did not. SMC corrects for it with weights.
Each of `n` independent runs holds `num_particles` particles (sequences of one request); a
particle samples from the masked model at the request's temperature, and its log-weight gains
at every sampled token the log of the probability mass (at that temperature, before the mask)
the mask kept, and at every forced token that token's own log-probability: exactly the
`constraint_logmass` of each of its positions (weft/engine/positions.py; the sampler reports an
SMC row's logprobs at its temperature). With `end_of_text` (the default) a particle whose
grammar finished samples its end-of-sequence token too (`PolicyRole.samples_end`), so that its
weight holds the probability that the text ends there; without, it ends where its grammar ends,
as masking's outputs do. The weight of a particle is then, in expectation over its future, the
probability under the model that its prefix ends as a string of the language, which is what
makes resampling valid at any step.

After every engine step, per run (`after_step`):
  1. start: the particles are forks of the first, each with its own noise stream, drawing their
     first token from the row of the prompt's last token (as the samples of `n` do);
  2. weigh: each particle adds the constraint log-mass of its new positions;
  3. a particle that finished keeps its weight if its text is a string of the language (it
     stopped), else its weight is -inf (max_tokens, an error), and it stops stepping;
  4. when every live particle has stepped since the last check and the effective sample size of
     their normalized weights is below `ess_threshold` times their number, resample them: each
     survives as often as the resampling scheme draws it (forked, sharing its KV blocks
     copy-on-write, its matcher forked, each child its own seed), the others are pruned and free
     their blocks at once; every live particle then carries the mean of their weights, so the
     run's total weight is unchanged;
  5. once every particle has finished: report ("sample": one particle per run drawn in
     proportion to its weight; "weighted": every particle with its normalized weight), and per
     run the log-marginal estimate log(mean of the final weights), the log of the probability
     that the model, unconstrained, produces a string of the language.
"""

from __future__ import annotations

import bisect
import itertools
import math
import random
from dataclasses import dataclass, field

from weft.engine.group import GroupUpdate, ParallelSampling, SequenceGroup, Spawner, check_logprob_limits
from weft.engine.sequence import FinishReason, PolicyRole, Sequence
from weft.outputs import RequestOutput, SMCRun
from weft.params import Resampling, SamplingParams, SMCOutput, SMCParams


@dataclass(slots=True, eq=False)
class Particle:
    seq: Sequence
    log_weight: float = 0.0
    num_weighed: int = 0  # the positions already added to `log_weight`
    stepped: bool = False  # since the last resampling check
    final: bool = False  # finished, its weight settled

    def weigh(self) -> None:
        """Add the constraint log-mass of the positions recorded since the last call; settle the
        weight once the sequence has finished."""
        if self.final:
            return
        seq = self.seq
        positions = seq.position_outputs
        assert positions is not None, "SMC particles track their positions"
        logmass = positions.constraint_logmass
        if len(logmass) > self.num_weighed:
            self.log_weight += math.fsum(logmass[self.num_weighed :])
            self.num_weighed = len(logmass)
            self.stepped = True
        if seq.is_finished:
            self.final, self.stepped = True, True
            if not _in_language(seq):
                self.log_weight = -math.inf


def _in_language(seq: Sequence) -> bool:
    """A finished particle's text is a string of the language: it stopped (at the end of its
    grammar, or with an end-of-sequence token, which its grammar allows only where the language
    does; stop strings and stop tokens are refused with SMC), not for its length or an error."""
    return seq.finish_reason == FinishReason.STOP


@dataclass(slots=True)
class ParticleRun:
    """One SMC run: its particles (live and finished, pruned ones gone) and its resampling steps."""

    particles: list[Particle]
    num_resampling_steps: int = 0

    @property
    def live(self) -> list[Particle]:
        return [p for p in self.particles if not p.final]

    def log_marginal(self) -> float:
        """log(mean weight): an unbiased estimate (in the weight) of the probability that the model
        produces a string of the language."""
        return _logsumexp([p.log_weight for p in self.particles]) - math.log(len(self.particles))

    def normalized(self) -> list[float]:
        """Each particle's log of its normalized weight."""
        total = _logsumexp([p.log_weight for p in self.particles])
        if total == -math.inf:
            return [-math.inf] * len(self.particles)
        return [p.log_weight - total for p in self.particles]


@dataclass(slots=True)
class SMC:
    """The policy of a request with `SamplingParams.smc`: `num_runs` (the request's `n`)
    independent runs of `num_particles` particles each."""

    params: SMCParams
    num_runs: int
    rng: random.Random  # the request's: seeds of forks, resampling draws, the reported sample
    spawner: Spawner | None = None
    starting: ParallelSampling | None = None  # the first particles, forks of the first sequence
    runs: list[ParticleRun] = field(default_factory=list)
    reported_particles: list[Particle] = field(default_factory=list)  # in output order, once finished

    @property
    def num_particles(self) -> int:
        return self.params.num_particles

    def validate(self, params: SamplingParams, vocab_size: int, max_logprobs: int) -> None:
        check_logprob_limits(params, max_logprobs)

    def allows_lookahead(self) -> bool:
        return False  # every step's weights decide the next resampling

    def start(self, group: SequenceGroup, first: Sequence, spawner: Spawner) -> None:
        self.spawner = spawner
        first.role = PolicyRole(samples_end=self.params.end_of_text)
        total = self.num_runs * self.num_particles
        self.starting = ParallelSampling(total, total)
        self.starting.start(group, first, spawner)
        for seq in self.starting.pending:
            seq.seed = self._new_seed()
        seqs = [first, *self.starting.pending]
        for r in range(self.num_runs):
            mine = seqs[r * self.num_particles : (r + 1) * self.num_particles]
            self.runs.append(ParticleRun([Particle(seq) for seq in mine]))

    def take_fanout(self, seq: Sequence, limit: int) -> list[Sequence]:
        return [] if self.starting is None else self.starting.take_fanout(seq, limit)

    def after_step(self, group: SequenceGroup) -> GroupUpdate:
        assert self.starting is not None
        update = self.starting.after_step(group)  # the first particles' forks, once the prompt is in
        forks, prunes = list(update.forks), list(update.prunes)
        for run in self.runs:
            for particle in run.particles:
                particle.weigh()
            live = run.live
            if live and all(p.stepped for p in live):
                for p in live:
                    p.stepped = False
                if _ess(live) < self.params.ess_threshold * len(live):
                    self._resample(group, run, live, forks, prunes)
        return GroupUpdate(forks=forks, prunes=prunes) if forks or prunes else update

    def _resample(
        self,
        group: SequenceGroup,
        run: ParticleRun,
        live: list[Particle],
        forks: list[tuple[Sequence, Sequence]],
        prunes: list[Sequence],
    ) -> None:
        """Draw len(live) survivors in proportion to their weights: a particle drawn k times keeps
        going and forks k - 1 children; one never drawn is pruned. Each then carries the mean
        weight of the live particles."""
        assert self.spawner is not None
        total = _logsumexp([p.log_weight for p in live])
        if total == -math.inf:
            return  # no live particle can reach the language: nothing to draw from
        counts = _draw(self.params.resampling, [math.exp(p.log_weight - total) for p in live], self.rng)
        mean = total - math.log(len(live))
        survivors: list[Particle] = []
        for particle, count in zip(live, counts, strict=True):
            if count == 0:
                prunes.append(particle.seq)
                group.remove(particle.seq)
                continue
            particle.log_weight = mean
            survivors.append(particle)
            for _ in range(count - 1):
                child = particle.seq.fork(self.spawner.next_id(), particle.seq.index, self._new_seed())
                forks.append((particle.seq, child))
                group.add([child])
                survivors.append(Particle(child, mean, particle.num_weighed))
        run.particles = [p for p in run.particles if p.final] + survivors
        run.num_resampling_steps += 1

    def _new_seed(self) -> int:
        return self.rng.getrandbits(62)

    def reported(self, group: SequenceGroup, finished: bool) -> list[Sequence] | None:
        if not finished:
            return None
        if not self.reported_particles:
            for r, run in enumerate(self.runs):
                for particle in run.particles:
                    particle.weigh()  # those that finished in the last step
                chosen = self._reported_of(run)
                for i, particle in enumerate(chosen):
                    weighted = self.params.output == SMCOutput.WEIGHTED
                    particle.seq.index = len(self.reported_particles) + i if weighted else r
                self.reported_particles += chosen
        return [p.seq for p in self.reported_particles]

    def _reported_of(self, run: ParticleRun) -> list[Particle]:
        """ "weighted": every particle, best weight first; "sample": one, drawn by weight (the first
        particle when none reached the language: its finish says why)."""
        weights = run.normalized()
        if self.params.output == SMCOutput.WEIGHTED:
            order = sorted(range(len(weights)), key=lambda i: -weights[i])
            return [run.particles[i] for i in order]
        if all(w == -math.inf for w in weights):
            return run.particles[:1]
        cumulative = list(itertools.accumulate(math.exp(w) for w in weights))
        drawn = bisect.bisect_right(cumulative, self.rng.random() * cumulative[-1])
        return [run.particles[min(drawn, len(weights) - 1)]]

    def annotate(self, output: RequestOutput) -> None:
        """The finished output's SMC fields: each completion's normalized log-weight in its run,
        each run's log-marginal estimate and resampling steps."""
        weights: dict[int, float] = {}  # seq_id -> normalized log-weight
        for run in self.runs:
            for particle, weight in zip(run.particles, run.normalized(), strict=True):
                weights[particle.seq.seq_id] = weight
        for completion, particle in zip(output.outputs, self.reported_particles, strict=True):
            completion.log_weight = weights[particle.seq.seq_id]
        output.smc = [
            SMCRun(run.log_marginal(), run.num_resampling_steps, self.num_particles) for run in self.runs
        ]


def _logsumexp(values: list[float]) -> float:
    top = max(values, default=-math.inf)
    if top == -math.inf:
        return -math.inf
    return top + math.log(math.fsum(math.exp(v - top) for v in values))


def _ess(particles: list[Particle]) -> float:
    """The effective sample size of the particles' normalized weights: 1 / sum(w^2)."""
    logs = [p.log_weight for p in particles]
    total = _logsumexp(logs)
    if total == -math.inf:
        return 0.0
    return 1.0 / math.fsum(math.exp(2.0 * (w - total)) for w in logs)


def _draw(scheme: Resampling, weights: list[float], rng: random.Random) -> list[int]:
    """How many times each of len(weights) particles is drawn, len(weights) draws in all, by
    `scheme` (weights normalized to sum 1)."""
    m = len(weights)
    if scheme == Resampling.MULTINOMIAL:
        points = sorted(rng.random() for _ in range(m))
    elif scheme == Resampling.STRATIFIED:
        points = [(i + rng.random()) / m for i in range(m)]
    else:
        u = rng.random()
        points = [(i + u) / m for i in range(m)]
    cumulative = list(itertools.accumulate(weights))
    cumulative[-1] = 1.0  # rounding: every point falls in some particle
    counts = [0] * m
    for point in points:
        counts[min(bisect.bisect_right(cumulative, point), m - 1)] += 1
    return counts
