"""How many tokens to draft: where speculation pays, and where it does not.

A draft token costs a share of a forward and is worth the chance that it is accepted. Two estimates
decide it, each a few float operations per row:

- `StepCost`, one per engine: a step's time against its token count, `t(T) = base + per_token * T`,
  fitted by exponentially weighted least squares over recent decode steps. One more token in a step
  of B rows costs `c(B) = per_token * B / t(B)` of what each of those rows' tokens cost: near 0 at
  batch 1 on a model whose forward streams its weights (the extra token rides on the same read),
  near 1 once the forward is compute-bound (large batches).
- `Acceptance`, one per sequence: the chance that its next draft token is accepted, `a`, estimated
  from its verifications (accepted tokens over accepted tokens plus rejections, exponentially
  weighted), starting from the engine's rate over its recent verifications (1/2 before any): a
  JSON extraction drafts a few values per request, too few for a per-sequence estimate alone.

The j-th draft token is accepted with chance about a^j, so a sequence drafts the j with
`a^j > c(B)`, at most `num_speculative_tokens`. A sequence that stops drafting (a <= c) tries one
draft token again every `PROBE_EVERY` steps, so that text that turns repetitive is noticed.

The line `t(T)` is a model, and a step's cost is not only its tokens: each draft row is sampled
over the whole vocabulary, a verifying step runs in turn rather than ahead, drafts are looked up on
the host. So a third measure has the last word, per batch size (to the power of two): `DraftGate`
keeps the tokens per second of steps that verified drafts and of steps that did not, and lets a
step draft only while drafting steps are the faster; it measures the other kind every
`GATE_PROBE_EVERY` steps times the square of how much slower it was (at most `GATE_PROBE_MOST`),
so that a change either way is noticed at a cost of at most 1/64 of the throughput. (A probe
that lasted until a step that drafted was measured, for JSON extraction, whose steps draft only
where a value opens, kept open text drafting too often: 0.90-0.96x at batch 8, docs/benchmarks.md.)
"""

from __future__ import annotations

import math
from dataclasses import dataclass

DECAY = 0.95  # per decode step, of the step-cost fit
PRIOR_SHARE = 0.02  # before any fit: one more token costs 2% of a one-row step
ACCEPTANCE_DECAY = 0.8  # per verification, of a sequence's acceptance estimate
POOLED_DECAY = 0.95  # per verification, of the engine's, over all its sequences
PRIOR_WEIGHT = 2.0  # the tokens' worth of a new sequence's first estimate (the engine's rate)
PROBE_EVERY = 16  # steps between single-token probes of a sequence that stopped drafting
GATE_DECAY = 0.7  # per measured step of a kind (a probe comes 16 to 128 steps after the last)
GATE_PROBE_EVERY = 16  # steps of the faster kind between two of the other, when they are close
GATE_PROBE_MOST = 128  # ... and at most, when the other is much slower (DraftGate.allows)
GATE_MIN_STEPS = 4  # measured steps of each kind before the gate compares them
GATE_KNOWN_MOST = 16  # known tokens a row computes at most in a step the gate measures (not prompts)


@dataclass(slots=True)
class StepCost:
    """Exponentially weighted least squares of decode steps' seconds against their tokens."""

    n: float = 0.0
    sx: float = 0.0
    sy: float = 0.0
    sxx: float = 0.0
    sxy: float = 0.0

    def record(self, num_tokens: int, seconds: float) -> None:
        if self.n == 0.0:  # a prior that the data soon outweighs: two pseudo-steps on the line
            base = seconds / (1 + PRIOR_SHARE * num_tokens)  # through this step, of slope PRIOR_SHARE * base
            for x in (1.0, 11.0):
                self._add(x, base * (1 + PRIOR_SHARE * x))
        self._add(float(num_tokens), seconds)

    def _add(self, x: float, y: float) -> None:
        self.n = self.n * DECAY + 1.0
        self.sx = self.sx * DECAY + x
        self.sy = self.sy * DECAY + y
        self.sxx = self.sxx * DECAY + x * x
        self.sxy = self.sxy * DECAY + x * y

    def share(self, batch: int) -> float:
        """c(B): one more token's cost over the cost per row of a step of `batch` rows."""
        if self.n == 0.0:
            return PRIOR_SHARE * batch / (1 + PRIOR_SHARE * batch)
        mean_x, mean_y = self.sx / self.n, self.sy / self.n
        var = self.sxx / self.n - mean_x * mean_x
        per_token = max((self.sxy / self.n - mean_x * mean_y) / var, 0.0) if var > 1e-9 else 0.0
        base = max(mean_y - per_token * mean_x, 0.0)
        step = base + per_token * batch
        return min(per_token * batch / step, 1.0) if step > 0 else 1.0


@dataclass(slots=True)
class Acceptance:
    """One sequence's chance that a draft token is accepted, and its idle count (or, with
    `POOLED_DECAY`, the engine's over all its sequences: a new sequence's first estimate)."""

    accepted: float = 1.0  # weighted accepted tokens (a prior of 1 in 2)
    tried: float = 2.0  # weighted accepted tokens + rejections
    idle: int = 0  # steps since it last drafted for want of a good chance
    decay: float = ACCEPTANCE_DECAY

    @classmethod
    def starting_at(cls, rate: float) -> Acceptance:
        """A new sequence's estimate: `rate` (what the engine's recent drafts got), worth
        `PRIOR_WEIGHT` tokens, so that its own verifications soon outweigh it."""
        return cls(accepted=PRIOR_WEIGHT * rate, tried=PRIOR_WEIGHT)

    def record(self, num_drafted: int, num_accepted: int) -> None:
        rejected = num_accepted < num_drafted  # tokens after the first rejection were never tested
        self.accepted = self.accepted * self.decay + num_accepted
        self.tried = self.tried * self.decay + num_accepted + rejected

    @property
    def rate(self) -> float:
        return self.accepted / self.tried

    def num_tokens(self, share: float, most: int) -> int:
        """How many draft tokens pay at cost share `share` (at most `most`), counting idle steps."""
        rate = self.rate
        if share <= 0.0:
            return most
        wanted = most if rate >= 1.0 else int(math.log(share) / math.log(rate)) if rate > share else 0
        if wanted > 0:
            self.idle = 0
            return min(wanted, most)
        self.idle += 1
        if self.idle >= PROBE_EVERY:
            self.idle = 0
            return 1
        return 0


@dataclass(slots=True)
class Rate:
    """Tokens per second over recent steps of one kind (exponentially weighted sums)."""

    tokens: float = 0.0
    seconds: float = 0.0
    steps: int = 0

    def add(self, tokens: int, seconds: float) -> None:
        self.tokens = self.tokens * GATE_DECAY + tokens
        self.seconds = self.seconds * GATE_DECAY + seconds
        self.steps += 1

    @property
    def per_second(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0


@dataclass(slots=True)
class GateBucket:
    drafting: Rate
    plain: Rate
    since_probe: int = 0  # steps of the faster kind since the other was last measured


class DraftGate:
    """Per batch size (to the power of two): whether this step may draft, by which kind of step,
    drafting or plain, has been producing tokens faster (see the module's docstring)."""

    def __init__(self) -> None:
        self.buckets: dict[int, GateBucket] = {}

    def _bucket(self, batch: int) -> GateBucket:
        key = 1 << max(batch - 1, 0).bit_length()  # 1, 2, 4, 8, ...
        bucket = self.buckets.get(key)
        if bucket is None:
            bucket = self.buckets[key] = GateBucket(Rate(), Rate())
        return bucket

    def allows(self, batch: int) -> bool:
        """Whether a step of `batch` running sequences may draft."""
        bucket = self._bucket(batch)
        if bucket.drafting.steps < GATE_MIN_STEPS:
            return True
        if bucket.plain.steps < GATE_MIN_STEPS:
            return False
        drafting, plain = bucket.drafting.per_second, bucket.plain.per_second
        drafting_pays = drafting >= plain
        # A probe of the slower kind costs (ratio - 1) / interval: probe less the slower it is.
        ratio = max(drafting, plain) / max(min(drafting, plain), 1e-9)
        interval = min(GATE_PROBE_EVERY * ratio * ratio, GATE_PROBE_MOST)
        bucket.since_probe += 1
        if bucket.since_probe >= interval:
            bucket.since_probe = 0
            return not drafting_pays  # one step of the other kind, measured
        return drafting_pays

    def record(self, batch: int, tokens: int, seconds: float, drafted: bool) -> None:
        """A decode step of `batch` rows emitted `tokens` in `seconds`, verifying drafts or not."""
        bucket = self._bucket(batch)
        (bucket.drafting if drafted else bucket.plain).add(tokens, seconds)
