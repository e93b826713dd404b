"""A launched step: what was scheduled, and its results on their way to the host.

`LLMEngine._launch` makes one per step (forward, sample, start the transfer); `results()` reads it
back, the one way a step's results reach the sequences (`LLMEngine._resolve`). With lookahead
(`weft/engine/lookahead.py`) a launched step may stay in flight until the next step is launched.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from weft.engine.runner import InFlightTokens, PromptSpan
from weft.engine.scheduler import Fanout, SampledRows, SchedulerOutput
from weft.engine.sequence import Sequence
from weft.logprob_records import LogprobRef
from weft.sample.transfer import StepTransfer

NON_FINITE_ERROR = (
    "the logits of this sequence were not finite (a NaN, or every token at -inf) after the logits "
    "processors and the grammar mask, so no token could be sampled; check the logits processors"
)


@dataclass(slots=True)
class Launched:
    sched: SchedulerOutput
    fanouts: list[Fanout]
    seqs: list[Sequence]  # the sampling rows in order, fanout children last
    tokens: torch.Tensor  # [S + F] int64, sampled, on the device
    transfer: StepTransfer
    errors: dict[int, str]  # row -> why it failed (a logits processor raised)
    spans: list[PromptSpan]  # the known tokens whose logprobs the step computed
    in_flight: InFlightTokens | None = field(default=None)  # set when it stays in flight (`commit`)

    def num_failed_rows(self, errors: dict[int, str]) -> int:
        """How many sequences' rows in `errors` failed (not counting draft rows)."""
        if not errors or self.sched.num_rows == len(self.sched.sampling):  # no drafts
            return len(errors)
        rows, row = set(), 0
        for item in self.sched.scheduled:
            if item.samples:
                rows.add(row)
                row += item.num_rows
        rows.update(range(row, row + len(self.seqs) - len(self.sched.sampling)))  # fanout children
        return len(rows & errors.keys())

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
