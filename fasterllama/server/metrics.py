"""Prometheus metrics of one server, in a registry of its own (two apps never share counters).

Counters and histograms are fed by the serving code as outputs arrive; the gauges and the
loop's counters (prefix cache, preemptions, speculative decoding) read the EngineLoop's published
stats snapshot when /metrics is scraped."""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily
from prometheus_client.registry import Collector

from ..engine.async_engine import EngineLoop, RequestHandle, SequenceOutput

STATUSES = ("ok", "rejected", "aborted", "error")

_TTFT_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0)
_ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5)
_E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0)

# The loop's running totals, read at each scrape: counters (they only grow), as Prometheus' rate() expects.
_LOOP_COUNTERS = (
    ("fasterllama_prefix_cache_queried_tokens", "Prompt tokens looked up in the prefix cache", "prefix_cache_queried_tokens"),
    ("fasterllama_prefix_cache_hit_tokens", "Prompt tokens found in the prefix cache (not computed)", "prefix_cache_hit_tokens"),
    ("fasterllama_preemptions", "Sequences preempted (blocks freed, recomputed later) for lack of KV cache blocks", "preemptions"),
    ("fasterllama_spec_decode_draft_tokens", "Speculative decoding: draft tokens verified", "spec_draft_tokens"),
    ("fasterllama_spec_decode_accepted_tokens", "Speculative decoding: draft tokens accepted", "spec_accepted_tokens"),
)


class _LoopCounters(Collector):
    def __init__(self, loop: EngineLoop) -> None:
        self.loop = loop

    def collect(self) -> Iterator[CounterMetricFamily]:
        stats = self.loop.stats
        for name, doc, field in _LOOP_COUNTERS:
            yield CounterMetricFamily(name, doc, value=getattr(stats, field))


class ServerMetrics:
    def __init__(self, loop: EngineLoop) -> None:
        self.registry = r = CollectorRegistry()
        self.requests = Counter("fasterllama_requests", "API requests by outcome: ok, rejected (4xx), aborted (client gone), error (5xx)",
                                ["status"], registry=r)
        for status in STATUSES:
            self.requests.labels(status=status)
        self.prompt_tokens = Counter("fasterllama_prompt_tokens", "Prompt tokens of accepted requests", registry=r)
        self.generation_tokens = Counter("fasterllama_generation_tokens", "Generated tokens", registry=r)
        self.ttft = Histogram("fasterllama_time_to_first_token_seconds", "From a request's arrival to each sequence's first token",
                              buckets=_TTFT_BUCKETS, registry=r)
        self.itl = Histogram("fasterllama_inter_token_latency_seconds", "Between consecutive tokens of a sequence",
                             buckets=_ITL_BUCKETS, registry=r)
        self.e2e = Histogram("fasterllama_e2e_request_latency_seconds", "From a request's arrival to each sequence's last token",
                             buckets=_E2E_BUCKETS, registry=r)
        self.finished = Counter("fasterllama_finished_sequences", "Sequences that ended by a stop (EOS, stop string or token) or their length",
                                ["finish_reason"], registry=r)
        for reason in ("stop", "length"):
            self.finished.labels(finish_reason=reason)
        gauges = [
            ("fasterllama_requests_running", "Requests with sequences in the KV cache", lambda: loop.stats.running_requests),
            ("fasterllama_requests_waiting", "Requests waiting for KV cache blocks or a seat", lambda: loop.stats.waiting_requests),
            ("fasterllama_kv_blocks_used", "KV cache blocks held by sequences", lambda: loop.stats.kv_blocks_used),
            ("fasterllama_kv_blocks_total", "KV cache blocks", lambda: loop.stats.kv_blocks_total),
        ]
        for name, doc, read in gauges:
            Gauge(name, doc, registry=r).set_function(read)
        r.register(_LoopCounters(loop))

    def count(self, status: str) -> None:
        self.requests.labels(status=status).inc()

    def count_http_error(self, status: int) -> None:
        self.count("aborted" if status == 499 else "error" if status >= 500 else "rejected")

    def observe(self, handle: RequestHandle, out: SequenceOutput, last_time: float | None) -> None:
        """One output of a sequence whose previous token came at last_time (None: first)."""
        if out.finish_reason is not None:
            self.finished.labels(finish_reason=out.finish_reason).inc()
            self.e2e.observe(max(0.0, out.time - handle.arrival_time))
        if not out.token_ids:
            return
        self.generation_tokens.inc(len(out.token_ids))
        if last_time is None:
            self.ttft.observe(max(0.0, out.time - handle.arrival_time))
        else:
            self.itl.observe(max(0.0, out.time - last_time))

    def render(self) -> tuple[bytes, str]:
        return generate_latest(self.registry), CONTENT_TYPE_LATEST
