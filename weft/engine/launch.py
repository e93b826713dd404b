"""A launched step: what was scheduled, and its results on their way to the host.

`LLMEngine._launch` makes one per step (forward, sample, start the transfer); `results()` reads it
back, the one way a step's results reach the sequences (`LLMEngine._resolve`). With lookahead
(`weft/engine/lookahead.py`) a launched step may stay in flight until the next step is launched.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from weft.engine.layout import SampledRows, SchedulerOutput, StepLayout
from weft.engine.runner import InFlightTokens, KnownSpan
from weft.logprob_records import LogprobRef
from weft.sample.transfer import StepTransfer

NON_FINITE_ERROR = (
    "the logits of this sequence were not finite (a NaN, or every token at -inf) after the logits "
    "processors and the grammar mask, so no token could be sampled; check the logits processors"
)


@dataclass(slots=True)
class Launched:
    layout: StepLayout  # what was scheduled, and whose each logits row is
    tokens: torch.Tensor  # [S + F] int64, sampled, on the device
    transfer: StepTransfer
    errors: dict[int, str]  # row -> why it failed (a logits processor raised)
    spans: list[KnownSpan]  # the known tokens whose logprobs the step computed
    in_flight: InFlightTokens | None = field(default=None)  # set when it stays in flight (`commit`)

    @property
    def sched(self) -> SchedulerOutput:
        return self.layout.sched

    def results(self) -> tuple[SampledRows, list[LogprobRef]]:
        """The step's results on the host: each sampling row's token, logprobs and error (a row
        whose logits were not finite fails with a message), and the known tokens' logprobs."""
        read = self.transfer.read()
        errors = self.errors
        if read.invalid_rows:
            errors = dict(errors)
            for row in read.invalid_rows:
                errors.setdefault(row, NON_FINITE_ERROR)
        return SampledRows(read.token_ids, read.logprobs, errors), read.known_logprobs
