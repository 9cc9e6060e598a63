"""Prometheus metrics of one server, in a registry of its own (two apps never share counters).

Counters and histograms are fed by the serving code as outputs arrive; the gauges read the
EngineLoop's published stats snapshot when /metrics is scraped."""

from __future__ import annotations

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)

from ..engine.async_engine import EngineLoop, RequestHandle, SequenceOutput

STATUSES = ("ok", "rejected", "aborted", "error")

_TTFT_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0)
_ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5)


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
        gauges = [
            ("fasterllama_requests_running", "Requests with sequences in the KV cache", lambda: loop.stats.running_requests),
            ("fasterllama_requests_waiting", "Requests waiting for KV cache blocks or a seat", lambda: loop.stats.waiting_requests),
            ("fasterllama_kv_blocks_used", "KV cache blocks held by sequences", lambda: loop.stats.kv_blocks_used),
            ("fasterllama_kv_blocks_total", "KV cache blocks", lambda: loop.stats.kv_blocks_total),
            ("fasterllama_prefix_cache_queried_tokens", "Prompt tokens looked up in the prefix cache",
             lambda: loop.stats.prefix_cache_queried_tokens),
            ("fasterllama_prefix_cache_hit_tokens", "Prompt tokens found in the prefix cache (not computed)",
             lambda: loop.stats.prefix_cache_hit_tokens),
            ("fasterllama_preemptions", "Sequences preempted (blocks freed, recomputed later) for lack of KV cache blocks",
             lambda: loop.stats.preemptions),
            ("fasterllama_spec_decode_draft_tokens", "Speculative decoding: draft tokens verified", lambda: loop.stats.spec_draft_tokens),
            ("fasterllama_spec_decode_accepted_tokens", "Speculative decoding: draft tokens accepted", lambda: loop.stats.spec_accepted_tokens),
        ]
        for name, doc, read in gauges:
            Gauge(name, doc, registry=r).set_function(read)

    def count(self, status: str) -> None:
        self.requests.labels(status=status).inc()

    def count_http_error(self, status: int) -> None:
        self.count("aborted" if status == 499 else "error" if status >= 500 else "rejected")

    def observe(self, handle: RequestHandle, out: SequenceOutput, last_time: float | None) -> None:
        """One output of a sequence whose previous token came at last_time (None: first)."""
        if not out.token_ids:
            return
        self.generation_tokens.inc(len(out.token_ids))
        if last_time is None:
            self.ttft.observe(max(0.0, out.time - handle.arrival_time))
        else:
            self.itl.observe(max(0.0, out.time - last_time))

    def render(self) -> tuple[bytes, str]:
        return generate_latest(self.registry), CONTENT_TYPE_LATEST
