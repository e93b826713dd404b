"""Prometheus metrics of one server (its own registry): requests, tokens, engine state, latency."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from weft.outputs import EngineStats

LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56, 5.12, 10.24, 20.48)


class _EngineCollector(Collector):
    """Engine gauges read at scrape time from the engine thread's latest snapshot."""

    def __init__(self, stats: Callable[[], EngineStats]) -> None:
        self.stats = stats

    def collect(self) -> Iterator[GaugeMetricFamily]:
        s = self.stats()
        queried = s.prefix_cache_queried_tokens
        for name, doc, value in (
            ("weft_num_requests_running", "sequences in the running batch", s.num_running),
            ("weft_num_requests_waiting", "sequences waiting to run (and grammars compiling)", s.num_waiting),
            ("weft_kv_blocks_used", "KV-cache blocks in use", s.kv_blocks_used),
            ("weft_kv_blocks_total", "KV-cache blocks in all", s.kv_blocks_total),
            (
                "weft_prefix_cache_hit_rate",
                "prompt tokens found in the prefix cache / prompt tokens looked up",
                s.prefix_cache_hit_tokens / queried if queried else 0.0,
            ),
        ):
            yield GaugeMetricFamily(name, doc, value=value)


class Metrics:
    def __init__(self, stats: Callable[[], EngineStats]) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter(
            "weft_requests", "finished requests by status", ["status"], registry=self.registry
        )
        self.prompt_tokens = Counter(
            "weft_prompt_tokens", "prompt tokens of served requests", registry=self.registry
        )
        self.generation_tokens = Counter(
            "weft_generation_tokens", "generated tokens of served requests", registry=self.registry
        )
        self.ttft = Histogram(
            "weft_time_to_first_token_seconds",
            "streaming requests: arrival to first generated token",
            buckets=LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.itl = Histogram(
            "weft_inter_token_latency_seconds",
            "streaming requests: time between two deliveries of new tokens",
            buckets=LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.registry.register(_EngineCollector(stats))

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
