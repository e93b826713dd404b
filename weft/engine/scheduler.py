"""Continuous batching.

Every request has one progress counter, `num_computed_tokens`, that catches up with `num_tokens`.
There is no prefill or decode phase: each step gives each request up to
`num_tokens - num_computed_tokens` new tokens, within the step's token budget. That one rule covers
prompts (chunked when long), decoding (one token), prefix-cache hits (counted as computed) and
tokens appended without sampling (not yet computed).

`schedule()`:
  1. serve running requests first, oldest first; when blocks run out, preempt the newest running
     request (free its blocks, recompute it later) until the older one fits;
  2. admit waiting requests in arrival order while the budget, `max_num_seqs` and the free blocks
     allow, starting each from its longest prefix-cache hit.
`update()` advances the counters, registers newly full blocks for prefix caching and appends the
sampled tokens. Requests that finish release their blocks at once.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from weft.config import SchedulerConfig
from weft.engine.kv_cache import KVCacheManager
from weft.request import FinishReason, Request, RequestStatus


@dataclass(frozen=True, slots=True)
class ScheduledRequest:
    request: Request
    num_new_tokens: int
    block_ids: list[int]  # the request's whole block table after this step's allocation
    samples: bool  # True when this step computes the request's last known token: it gets logits


@dataclass(frozen=True, slots=True)
class SchedulerOutput:
    scheduled: list[ScheduledRequest]
    num_batched_tokens: int
    block_copies: list[tuple[int, int]]  # (src, dst) block ids to copy before the forward pass
    preempted_ids: list[str]

    @property
    def sampling(self) -> list[ScheduledRequest]:
        return [s for s in self.scheduled if s.samples]

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv: KVCacheManager) -> None:
        self.config = config
        self.kv = kv
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.num_preemptions = 0

    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def add_forked(self, parent: Request, child: Request) -> None:
        """Add `child`, a copy of `parent`'s tokens, sharing the parent's KV blocks. The child
        recomputes the parent's last token, so that it gets logits of its own to sample from."""
        self.requests[child.request_id] = child
        self.kv.fork(parent.request_id, child)
        child.num_computed_tokens = min(parent.num_computed_tokens, child.num_tokens - 1)
        child.status = RequestStatus.RUNNING
        self.running.append(child)

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running)

    def schedule(self) -> SchedulerOutput:
        budget = self.config.max_num_batched_tokens
        scheduled: list[ScheduledRequest] = []
        preempted: list[str] = []
        budget = self._schedule_running(budget, scheduled, preempted)
        if not preempted:
            self._schedule_waiting(budget, scheduled)
        return SchedulerOutput(
            scheduled=scheduled,
            num_batched_tokens=sum(s.num_new_tokens for s in scheduled),
            block_copies=self.kv.take_pending_copies(),
            preempted_ids=preempted,
        )

    def _schedule_running(self, budget: int, scheduled: list[ScheduledRequest], preempted: list[str]) -> int:
        idx = 0
        while idx < len(self.running) and budget > 0:
            request = self.running[idx]
            num_new = min(request.num_tokens - request.num_computed_tokens, budget)
            if num_new <= 0:
                idx += 1
                continue
            block_ids = self.kv.allocate_slots(request, num_new)
            while block_ids is None:
                victim = self.running.pop()
                self._preempt(victim)
                preempted.append(victim.request_id)
                if victim is request:
                    break
                block_ids = self.kv.allocate_slots(request, num_new)
            if block_ids is None:
                break
            scheduled.append(self._scheduled(request, num_new, block_ids))
            budget -= num_new
            idx += 1
        return budget

    def _schedule_waiting(self, budget: int, scheduled: list[ScheduledRequest]) -> None:
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            request = self.waiting[0]
            computed = self.kv.get_computed_blocks(request) if request.num_computed_tokens == 0 else None
            num_cached = computed.num_tokens(self.kv.block_size) if computed else 0
            num_new = min(request.num_tokens - request.num_computed_tokens - num_cached, budget)
            block_ids = self.kv.allocate_slots(request, num_new, computed)
            if block_ids is None:
                break
            self.waiting.popleft()
            if request.status == RequestStatus.WAITING:
                request.num_cached_prompt_tokens = num_cached
                self.kv.record_prefix_query(request.num_tokens, num_cached)
            request.num_computed_tokens += num_cached
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            scheduled.append(self._scheduled(request, num_new, block_ids))
            budget -= num_new

    def _scheduled(self, request: Request, num_new: int, block_ids: list[int]) -> ScheduledRequest:
        samples = request.num_computed_tokens + num_new == request.num_tokens
        return ScheduledRequest(request, num_new, block_ids, samples)

    def _preempt(self, request: Request) -> None:
        self.kv.free(request.request_id)
        request.num_computed_tokens = 0
        request.status = RequestStatus.PREEMPTED
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(request)

    def update(self, output: SchedulerOutput, sampled_token_ids: list[int]) -> list[Request]:
        """Advance every scheduled request and append the sampled tokens (one per sampling request,
        in `output.sampling` order). Returns the requests that received a token."""
        advanced: list[Request] = []
        tokens = iter(sampled_token_ids)
        for item in output.scheduled:
            request = item.request
            token = next(tokens) if item.samples else None
            if request.is_finished:  # finished (aborted, failed) since it was scheduled
                continue
            request.num_computed_tokens += item.num_new_tokens
            self.kv.cache_full_blocks(request)
            if token is not None:
                request.token_ids.append(token)
                advanced.append(request)
        return advanced

    def finish(
        self,
        request: Request,
        reason: FinishReason,
        stop_reason: str | int | None = None,
        error: str | None = None,
    ) -> None:
        """Finish `request` now and release its blocks."""
        if request.is_finished:
            return
        request.finish(reason, stop_reason, error)
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        self.kv.free(request.request_id)
        self.requests.pop(request.request_id, None)

    def abort(self, request_id: str) -> Request | None:
        request = self.requests.get(request_id)
        if request is not None:
            self.finish(request, FinishReason.ABORT)
        return request
