"""Prometheus metrics of one server (its own registry), under vLLM's names and meanings where vLLM
has a name, so that routers and autoscalers built for vLLM (vllm-router, sglang-router, KServe,
llm-d) read weft as they read vLLM; `weft_*` for the rest.

vLLM's (each with a `model_name` label): `vllm:num_requests_running` and
`vllm:num_requests_waiting` (requests, not sequences: an n=4 request is one),
`vllm:kv_cache_usage_perc` (0 to 1), `vllm:prompt_tokens_total`, `vllm:generation_tokens_total`,
`vllm:request_success_total{finished_reason}`, `vllm:prefix_cache_queries_total` and
`vllm:prefix_cache_hits_total` (tokens), and the histograms `vllm:time_to_first_token_seconds`,
`vllm:inter_token_latency_seconds` (streaming requests) and `vllm:e2e_request_latency_seconds`.
With `--speculative-config`: `vllm:spec_decode_num_drafts_total`, `vllm:spec_decode_num_draft_tokens_total`
and `vllm:spec_decode_num_accepted_tokens_total`.
weft's own: `weft_requests_total{status}` (ok, error, rejected, aborted), `weft_kv_blocks_used`,
`weft_kv_blocks_total`, `weft_num_sequences_running`, `weft_num_sequences_waiting`.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from weft.outputs import EngineStats, RequestOutput

LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56, 5.12, 10.24, 20.48)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0)
MODEL = ["model_name"]


class _EngineCollector(Collector):
    """Engine gauges and cumulative counts read at scrape time from the engine thread's latest
    snapshot."""

    def __init__(self, stats: Callable[[], EngineStats], model_name: str) -> None:
        self.stats = stats
        self.model_name = model_name

    def collect(self) -> Iterator[Metric]:
        s = self.stats()
        usage = s.kv_blocks_used / s.kv_blocks_total if s.kv_blocks_total else 0.0
        for name, doc, value in (
            ("vllm:num_requests_running", "requests with a sequence running", s.num_requests_running),
            ("vllm:num_requests_waiting", "requests waiting to run (grammars compiling included)",
             s.num_requests_waiting),
            ("vllm:kv_cache_usage_perc", "KV-cache usage: 1 means every block in use", usage),
        ):  # fmt: skip
            gauge = GaugeMetricFamily(name, doc, labels=MODEL)
            gauge.add_metric([self.model_name], value)
            yield gauge
        for name, doc, value in (
            ("vllm:prefix_cache_queries", "prompt tokens looked up in the prefix cache",
             s.prefix_cache_queried_tokens),
            ("vllm:prefix_cache_hits", "prompt tokens found in the prefix cache", s.prefix_cache_hit_tokens),
        ):  # fmt: skip
            counter = CounterMetricFamily(name, doc, labels=MODEL)
            counter.add_metric([self.model_name], value)
            yield counter
        yield from self._speculation(s)
        for name, doc, value in (
            ("weft_num_sequences_running", "sequences in the running batch", s.num_running),
            ("weft_num_sequences_waiting", "sequences waiting to run", s.num_waiting),
            ("weft_kv_blocks_used", "KV-cache blocks in use", s.kv_blocks_used),
            ("weft_kv_blocks_total", "KV-cache blocks in all", s.kv_blocks_total),
        ):
            yield GaugeMetricFamily(name, doc, value=value)

    def _speculation(self, s: EngineStats) -> Iterator[Metric]:
        """vLLM's speculative-decoding counters, where the engine speculates."""
        for key, doc in SPECULATION_COUNTERS:
            if key in s.extra:
                counter = CounterMetricFamily(f"vllm:{key}", doc, labels=MODEL)
                counter.add_metric([self.model_name], s.extra[key])
                yield counter


SPECULATION_COUNTERS = (
    ("spec_decode_num_drafts", "verifications of drafted tokens (one per sequence and step that drafted)"),
    ("spec_decode_num_draft_tokens", "drafted tokens verified"),
    ("spec_decode_num_accepted_tokens", "drafted tokens accepted"),
)


class Metrics:
    def __init__(self, stats: Callable[[], EngineStats], model_name: str) -> None:
        self.model_name = model_name
        registry = self.registry = CollectorRegistry()
        self.requests = Counter("weft_requests", "finished requests by status", ["status"], registry=registry)
        self._prompt_tokens = Counter(
            "vllm:prompt_tokens", "prompt tokens of served requests", MODEL, registry=registry
        )
        self._generation_tokens = Counter(
            "vllm:generation_tokens", "generated tokens of served requests", MODEL, registry=registry
        )
        self._success = Counter(
            "vllm:request_success",
            "requests that finished, by finish reason (stop, length, abort)",
            [*MODEL, "finished_reason"],
            registry=registry,
        )
        self.ttft = self._histogram(
            "vllm:time_to_first_token_seconds", "streaming requests: arrival to first generated token"
        )
        self.itl = self._histogram(
            "vllm:inter_token_latency_seconds", "streaming requests: time between two deliveries of tokens"
        )
        self.e2e = self._histogram(
            "vllm:e2e_request_latency_seconds", "arrival to finish, every request", E2E_BUCKETS
        )
        registry.register(_EngineCollector(stats, model_name))

    def _histogram(self, name: str, doc: str, buckets: tuple[float, ...] = LATENCY_BUCKETS) -> Histogram:
        return Histogram(name, doc, MODEL, buckets=buckets, registry=self.registry).labels(self.model_name)

    def count_tokens(self, prompt_tokens: int, generation_tokens: int) -> None:
        self._prompt_tokens.labels(self.model_name).inc(prompt_tokens)
        self._generation_tokens.labels(self.model_name).inc(generation_tokens)

    def request_finished(self, output: RequestOutput | None, seconds: float) -> None:
        """An engine request finished (`output`, its last) or was aborted (None), `seconds` after it
        arrived."""
        reasons = [c.finish_reason for c in output.outputs] if output is not None else ["abort"]
        if "error" in reasons:
            return  # not a success: weft_requests_total{status="error"} counts it
        reason = "length" if "length" in reasons else (reasons[0] or "stop")
        self._success.labels(self.model_name, reason).inc()
        self.e2e.observe(seconds)

    def render(self) -> bytes:
        return generate_latest(self.registry)


class LatencyTracker:
    """Time to first token and inter-token latency of one streaming request."""

    def __init__(self, metrics: Metrics) -> None:
        self.metrics = metrics
        self.start = time.perf_counter()
        self.last: float | None = None

    def tokens_arrived(self) -> None:
        now = time.perf_counter()
        if self.last is None:
            self.metrics.ttft.observe(now - self.start)
        else:
            self.metrics.itl.observe(now - self.last)
        self.last = now
