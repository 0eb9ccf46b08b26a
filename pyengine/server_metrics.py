"""The server's Prometheus metrics (GET /metrics, text exposition format), one registry per app.

    ringllm_requests_total{outcome}                 completed | cancelled | failed
    ringllm_prompt_tokens_total                     prompt tokens of finished requests (cached ones included)
    ringllm_prompt_tokens_cached_total              of those, tokens the prompt cache gave (not prefilled)
    ringllm_completion_tokens_total                 tokens generated
    ringllm_kv_evictions_total                      slots the requests' KV stores evicted (per layer and KV head)
    ringllm_queue_depth, ringllm_active_requests    requests waiting / being decoded (read at scrape time)
    ringllm_batch_size                              histogram: sequences per batched engine step
    ringllm_time_to_first_token_seconds             histogram: from the request's arrival at the worker
                                                    queue to its first token (queueing and prefill included)
    ringllm_inter_token_seconds                     histogram: between a request's consecutive tokens
    ringllm_request_duration_seconds                histogram: arrival to last token
    ringllm_prompt_cache_{entries,bytes,hits,misses,evictions}   (read at scrape time)
    process_resident_memory_bytes, process_cpu_seconds_total, ...   (prometheus_client's process collector)

The worker thread records; the scrape reads (prometheus_client is thread-safe). A registry per
ServerMetrics, so that several apps in one process (tests) never share counters.
"""
from __future__ import annotations

import time

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, ProcessCollector, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

__all__ = ["CONTENT_TYPE_LATEST", "ServerMetrics"]

_LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0, 60.0)
_TOKEN_BUCKETS = (0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0)


class ServerMetrics:
    """The metrics of one server (module docstring). bind(worker) connects the gauges read at scrape
    time (queue depth, active requests, the prompt cache)."""

    def __init__(self):
        r = self.registry = CollectorRegistry()
        ProcessCollector(registry=r)         # process_resident_memory_bytes, process_cpu_seconds_total, ...
        self.requests = Counter("ringllm_requests", "Requests that reached the engine, by outcome", ["outcome"],
                                registry=r)
        for outcome in ("completed", "cancelled", "failed"):
            self.requests.labels(outcome)
        self.prompt_tokens = Counter("ringllm_prompt_tokens", "Prompt tokens of finished requests", registry=r)
        self.cached_tokens = Counter("ringllm_prompt_tokens_cached", "Prompt tokens taken from the prompt cache",
                                     registry=r)
        self.completion_tokens = Counter("ringllm_completion_tokens", "Tokens generated", registry=r)
        self.evictions = Counter("ringllm_kv_evictions", "KV slots evicted by the requests' stores, summed over "
                                 "layers and KV heads (kv_stats evicted_total)", registry=r)
        self.queue_depth = Gauge("ringllm_queue_depth", "Requests waiting for the engine", registry=r)
        self.active = Gauge("ringllm_active_requests", "Requests being decoded", registry=r)
        self.batch_size = Histogram("ringllm_batch_size", "Sequences per engine step", registry=r,
                                    buckets=(1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 64))
        self.ttft = Histogram("ringllm_time_to_first_token_seconds", "Arrival to first token", registry=r,
                              buckets=_LATENCY_BUCKETS)
        self.inter_token = Histogram("ringllm_inter_token_seconds", "Time between a request's tokens", registry=r,
                                     buckets=_TOKEN_BUCKETS)
        self.duration = Histogram("ringllm_request_duration_seconds", "Arrival to last token", registry=r,
                                  buckets=_LATENCY_BUCKETS)
        self.cache_entries = Gauge("ringllm_prompt_cache_entries", "Stores in the prompt cache", registry=r)
        self.cache_bytes = Gauge("ringllm_prompt_cache_bytes", "Bytes held by the prompt cache", registry=r)
        self.cache_hits = Gauge("ringllm_prompt_cache_hits", "Requests that continued a cached store",
                                registry=r)
        self.cache_misses = Gauge("ringllm_prompt_cache_misses", "Requests that found no cached store",
                                  registry=r)
        self.cache_evictions = Gauge("ringllm_prompt_cache_evictions", "Stores dropped to stay in budget",
                                     registry=r)

    def bind(self, worker) -> None:
        """Read the worker's queue, batch and prompt cache at scrape time."""
        self.queue_depth.set_function(worker.jobs.qsize)
        self.active.set_function(lambda: worker.active)
        cache = getattr(worker, "cache", None)
        if cache is None:           # a host whose caches live elsewhere (the Ray replicas)
            return
        self.cache_entries.set_function(lambda: len(cache))
        self.cache_bytes.set_function(lambda: cache.bytes)
        self.cache_hits.set_function(lambda: cache.hits)
        self.cache_misses.set_function(lambda: cache.misses)
        self.cache_evictions.set_function(lambda: cache.evictions)

    # ---------------------------------------------------------------------- worker-side records

    def first_token(self, seconds: float) -> None:
        self.ttft.observe(seconds)

    def token(self, seconds: float) -> None:
        self.inter_token.observe(seconds)

    def batch(self, size: int) -> None:
        self.batch_size.observe(size)

    def failed(self) -> None:
        self.requests.labels("failed").inc()

    def finished(self, outcome: str, job, dec, evicted: int = 0) -> None:
        """A request that got its store: completed, or cancelled between two tokens."""
        self.requests.labels(outcome).inc()
        self.prompt_tokens.inc(len(job.ids))
        self.cached_tokens.inc(job.cached)
        self.completion_tokens.inc(len(dec.record.tokens))
        if evicted > 0:
            self.evictions.inc(evicted)
        self.duration.observe(time.perf_counter() - job.submitted)

    def render(self) -> bytes:
        return generate_latest(self.registry)
