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
  weighted, starting from 1/2).

The j-th draft token is accepted with chance about a^j, so a sequence drafts the j with
`a^j > c(B)`, at most `num_speculative_tokens`. A sequence that stops drafting (a <= c) tries one
draft token again every `PROBE_EVERY` steps, so that text that turns repetitive is noticed.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

DECAY = 0.95  # per decode step, of the step-cost fit
PRIOR_SHARE = 0.02  # before any fit: one more token costs 2% of a one-row step
ACCEPTANCE_DECAY = 0.8  # per verification, of a sequence's acceptance estimate
PROBE_EVERY = 16  # steps between single-token probes of a sequence that stopped drafting


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
    """One sequence's chance that a draft token is accepted, and its idle count."""

    accepted: float = 1.0  # weighted accepted tokens (a prior of 1 in 2)
    tried: float = 2.0  # weighted accepted tokens + rejections
    idle: int = 0  # steps since it last drafted for want of a good chance

    def record(self, num_drafted: int, num_accepted: int) -> None:
        rejected = num_accepted < num_drafted  # tokens after the first rejection were never tested
        self.accepted = self.accepted * ACCEPTANCE_DECAY + num_accepted
        self.tried = self.tried * ACCEPTANCE_DECAY + num_accepted + rejected

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
