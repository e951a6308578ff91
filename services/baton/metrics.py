"""Prometheus metrics of every baton service, defined in one place, grouped per service.

Each server builds its group on a registry of its own (``CollectorRegistry``), so several
servers can live in one process (tests, ``baton up`` in one interpreter) without clashing
names, and ``serve_metrics(host, port, registry)`` exposes it over HTTP on
``server.metrics_host`` when ``server.metrics_port`` is non-zero. Names follow Prometheus conventions: a ``baton_``
prefix, the service, base units in the name (``_seconds``, ``_bytes``), ``_total`` on
counters.
"""

from __future__ import annotations

import itertools
import logging
import socket
import threading
from collections.abc import Callable
from socketserver import ThreadingMixIn
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, make_wsgi_app

from baton.vllm_metrics import VllmEngineMetrics, VllmRequestLatencies, prompt_tokens_counter

log = logging.getLogger(__name__)

# Latency buckets in seconds: a token every few ms on a GPU up to a long CPU prefill; fine
# enough between 10 ms and 5 s that a P90 read from them (the autoscaling planner's
# targets) is within a bucket's width of the truth.
LATENCY_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.03, 0.04, 0.05, 0.075, 0.1,
                     0.125, 0.15, 0.2, 0.25, 0.3, 0.4, 0.5, 0.75, 1.0, 1.5, 2.0, 2.5, 3.0, 4.0,
                     5.0, 7.5, 10.0, 15.0, 30.0, 60.0)
# Tokens of one prompt or one answer: the planner reads their distributions from these.
TOKEN_BUCKETS = (16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512, 768, 1024, 1536, 2048, 3072,
                 4096, 6144, 8192, 12288, 16384, 24576, 32768, 65536, 131072)
# Kept / full KV entries: 1.0 = no compression.
RATIO_BUCKETS = (0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0)


class DecodeMetrics:
    """`baton decode`: latency of the token stream, load, the KV pool and pushed caches; and
    vLLM's series for the same engine (``vllm``, labelled with the served ``model_name``)."""

    def __init__(self, registry: CollectorRegistry, model_name: str) -> None:
        self.registry = registry
        self.vllm = VllmEngineMetrics(registry, model_name)
        self.ttft_s = Histogram(
            "baton_decode_time_to_first_token_seconds",
            "request arrival on this pod to its first token (local prefills; a pushed "
            "request's first token comes from the chain)", buckets=LATENCY_BUCKETS_S,
            registry=registry)
        self.time_between_tokens_s = Histogram(
            "baton_decode_time_between_tokens_seconds", "gap between consecutive streamed tokens "
            "of one request", buckets=LATENCY_BUCKETS_S, registry=registry)
        self.queued_requests = Gauge(
            "baton_decode_queued_requests", "requests waiting for admission", registry=registry)
        self.queued_prompt_tokens = Gauge(
            "baton_decode_queued_prompt_tokens", "prompt tokens waiting to be prefilled here",
            registry=registry)
        self.running_sequences = Gauge(
            "baton_decode_running_sequences", "sequences prefilling or decoding", registry=registry)
        self.kv_blocks_used = Gauge(
            "baton_decode_kv_blocks_used", "KV pool blocks in use", registry=registry)
        self.kv_blocks_total = Gauge(
            "baton_decode_kv_blocks_total", "KV pool blocks in all", registry=registry)
        self.kv_pushes_in_progress = Gauge(
            "baton_decode_kv_pushes_in_progress", "KV uploads being received now (at most "
            "kv.max_pending_pushes)", registry=registry)
        self.kv_leases_expired = Counter(
            "baton_decode_kv_leases_expired_total", "pushed caches freed because no Attach "
            "claimed them within the lease", registry=registry)
        self.kv_pushes_rejected = Counter(
            "baton_decode_kv_pushes_rejected_total", "PushKV streams refused, by gRPC status",
            ["code"], registry=registry)
        self.kv_bytes_received = Counter(
            "baton_decode_kv_bytes_received_total", "bytes of pushed caches taken, by the data "
            "plane that carried them (grpc: the PushKV stream; nixl: a NIXL read)",
            ["transport"], registry=registry)
        self.kv_pushes_landed = Counter(
            "baton_decode_kv_pushes_landed_total", "pushed caches copied into the pool's "
            "blocks as they arrived (the others were kept whole and copied at admission)",
            registry=registry)
        self.compression_ratio = Histogram(
            "baton_decode_kv_compression_ratio", "kept / full KV entries of each pushed cache",
            buckets=RATIO_BUCKETS, registry=registry)
        self.requests_finished = Counter(
            "baton_decode_requests_finished_total", "finished requests, by finish reason",
            ["reason"], registry=registry)
        self.door_requests_refused = Counter(
            "baton_decode_door_requests_refused_total", "requests the pod's own OpenAI door "
            "(--http-port) refused before routing them, by gRPC status", ["code"],
            registry=registry)
        self.prefix_lookups = Counter(
            "baton_decode_prefix_cache_lookups_total", "prompts admitted that looked for a cached "
            "prefix (hit rate by requests: hits / lookups)", registry=registry)
        self.prefix_hits = Counter(
            "baton_decode_prefix_cache_hits_total", "prompts admitted that took at least one "
            "cached block", registry=registry)
        self.prefix_tokens_looked_up = Counter(
            "baton_decode_prefix_cache_prompt_tokens_total", "tokens of the prompts that looked "
            "(hit rate by tokens: hit_tokens / prompt_tokens)", registry=registry)
        self.prefix_tokens_hit = Counter(
            "baton_decode_prefix_cache_hit_tokens_total", "prompt tokens taken from the cache",
            registry=registry)
        self.prefix_evictions = Counter(
            "baton_decode_prefix_cache_evictions_total", "cached blocks the pool took back",
            registry=registry)
        self.prefix_cached_blocks = Gauge(
            "baton_decode_prefix_cache_blocks", "cached blocks (each spans every layer), held "
            "or evictable", registry=registry)
        self._prefix_seen = None  # the cache's counters at the last record_prefix_cache

    def record_prefix_cache(self, stats, num_cached_blocks: int) -> None:
        """Bring the counters up to a ``baton.kv.prefix_cache.CacheStats`` snapshot (a copy)."""
        seen = self._prefix_seen
        for counter, name in ((self.prefix_lookups, "lookups"), (self.prefix_hits, "hits"),
                              (self.prefix_tokens_looked_up, "tokens_looked_up"),
                              (self.prefix_tokens_hit, "tokens_hit"),
                              (self.prefix_evictions, "evicted")):
            counter.inc(getattr(stats, name) - (getattr(seen, name) if seen else 0))
        self._prefix_seen = stats
        self.prefix_cached_blocks.set(num_cached_blocks)
        self.vllm.record_prefix_cache(stats.tokens_looked_up, stats.tokens_hit)


class PrefillMetrics:
    """`baton prefill` (rank 0 and the tail of a chain): queue, first tokens, shipped caches;
    and vLLM's prompt token counter (the tail's, labelled with the served ``model_name``)."""

    def __init__(self, registry: CollectorRegistry, model_name: str) -> None:
        self.registry = registry
        self.vllm_prompt_tokens = prompt_tokens_counter(registry, model_name)
        self.queue_s = Histogram(
            "baton_prefill_queue_seconds", "request arrival at rank 0 to the chain starting it",
            buckets=LATENCY_BUCKETS_S, registry=registry)
        self.kv_push_s = Histogram(
            "baton_prefill_kv_push_seconds", "shipping one cache to a decode pod, from the "
            "logits to the pod's answer (by layer: the last layer's part, the rest went "
            "during the compute)",
            buckets=LATENCY_BUCKETS_S, registry=registry)
        self.queued_requests = Gauge(
            "baton_prefill_queued_requests", "requests accepted by rank 0 whose caller still waits on the chain",
            registry=registry)
        self.queued_prompt_tokens = Gauge(
            "baton_prefill_queued_prompt_tokens", "prompt tokens of those requests",
            registry=registry)
        self.kv_bytes_shipped = Counter(
            "baton_prefill_kv_bytes_shipped_total", "bytes of KV cache pushed to decode pods",
            registry=registry)
        self.compression_ratio = Histogram(
            "baton_prefill_kv_compression_ratio", "kept / full KV entries of each shipped cache",
            buckets=RATIO_BUCKETS, registry=registry)
        self.partition_fraction = Gauge(
            "baton_prefill_partition_fraction", "fraction of the last prompt each rank computed",
            ["rank"], registry=registry)
        self.requests_finished = Counter(
            "baton_prefill_requests_finished_total", "finished prefill requests, by outcome",
            ["outcome"], registry=registry)
        self.prompt_tokens = Counter(
            "baton_prefill_prompt_tokens_total", "prompt tokens this chain prefilled",
            registry=registry)
        self.compute_s = Histogram(
            "baton_prefill_compute_seconds", "the chain's compute time of one prompt (its header "
            "reaching the tail to the tail's logits; no queue)", buckets=LATENCY_BUCKETS_S,
            registry=registry)

    def record_prefill(self, num_prompt_tokens: int, compute_s: float) -> None:
        """One prompt prefilled: what the planner's prefill model is fitted from."""
        self.prompt_tokens.inc(num_prompt_tokens)
        self.vllm_prompt_tokens.inc(num_prompt_tokens)
        self.compute_s.observe(compute_s)

    def record_partition(self, boundaries: list[int] | tuple[int, ...]) -> None:
        """The slices [b0=0, b1, ..., bp=C] of the latest request, as fractions of C."""
        context_length = boundaries[-1]
        for rank, (start, end) in enumerate(itertools.pairwise(boundaries)):
            self.partition_fraction.labels(rank=str(rank)).set((end - start) / context_length)


class GatewayMetrics:
    """`baton gateway`: what clients see (latency from the gateway's clock) and where it routed;
    and vLLM's request latencies of the requests a chain prefilled (``vllm``: no decode pod saw
    them arrive)."""

    def __init__(self, registry: CollectorRegistry, model_name: str) -> None:
        self.registry = registry
        self.vllm = VllmRequestLatencies(registry, model_name)
        self.ttft_s = Histogram(
            "baton_gateway_time_to_first_token_seconds", "request arrival at the gateway to its "
            "first token, by path (chain or local prefill)", ["path"], buckets=LATENCY_BUCKETS_S,
            registry=registry)
        self.time_between_tokens_s = Histogram(
            "baton_gateway_time_between_tokens_seconds", "gap between consecutive streamed "
            "messages of one request", buckets=LATENCY_BUCKETS_S, registry=registry)
        self.requests_in_flight = Gauge(
            "baton_gateway_requests_in_flight", "Generate streams open now", registry=registry)
        self.requests_finished = Counter(
            "baton_gateway_requests_finished_total", "finished Generate calls, by path and "
            "outcome (a finish reason or a gRPC status)", ["path", "outcome"], registry=registry)
        self.kv_bytes_shipped = Counter(
            "baton_gateway_kv_bytes_shipped_total", "bytes of KV pushed from chains to decode "
            "pods for this gateway's requests", registry=registry)
        self.compression_ratio = Histogram(
            "baton_gateway_kv_compression_ratio", "kept / full KV entries per finished request",
            buckets=RATIO_BUCKETS, registry=registry)
        self.live_workers = Gauge(
            "baton_gateway_live_workers", "workers in the routing view, by role", ["role"],
            registry=registry)
        self.migrations = Counter(
            "baton_gateway_migrations_total", "streams moved to another decode pod after theirs "
            "failed mid-stream, by the failure's gRPC status", ["code"], registry=registry)
        self.chain_fallbacks = Counter(
            "baton_gateway_chain_fallbacks_total", "chain requests prefilled on a decode pod "
            "instead, after the chain failed them, by the failure's gRPC status", ["code"],
            registry=registry)
        self.kv_contract_mismatches = Counter(
            "baton_gateway_kv_contract_mismatches_total", "chains passed over by a routing "
            "decision because their KV contract does not fit the decode pod's (model revision, "
            "KV dtype, layout or compression differ; the route's reason names which)",
            registry=registry)
        self.routing_view_stale = Gauge(
            "baton_gateway_routing_view_stale", "1 while the routing store cannot be read and "
            "the gateway routes from its last view", registry=registry)
        self.prefix_index_age_s = Gauge(
            "baton_gateway_prefix_index_lag_seconds", "age of the gateway's index of the decode "
            "pods' prefix caches at the latest routing decision (time since it last read their "
            "events)", registry=registry)
        self.prompt_tokens = Histogram(
            "baton_gateway_prompt_tokens", "prompt tokens of each finished request",
            buckets=TOKEN_BUCKETS, registry=registry)
        self.output_tokens = Histogram(
            "baton_gateway_output_tokens", "tokens generated for each finished request",
            buckets=TOKEN_BUCKETS, registry=registry)

    def record_lengths(self, num_prompt_tokens: int, num_output_tokens: int) -> None:
        """A finished request's lengths (the planner sizes prefill and decode from them)."""
        self.prompt_tokens.observe(num_prompt_tokens)
        self.output_tokens.observe(num_output_tokens)


class PlannerMetrics:
    """`baton up --autoscale`: the planner's size per role beside what runs; the supervisor
    writes them as a text file that the gateway's HTTP ``/metrics`` adds to its own."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.registry = registry
        self.target_replicas = Gauge(
            "baton_planner_target_replicas", "decode pods or prefill chains the planner's latest "
            "decision asks for, by role", ["role"], registry=registry)
        self.replicas = Gauge(
            "baton_replicas", "decode pods or prefill chains running or starting now, by role (a "
            "decode pod draining for removal no longer counts)", ["role"], registry=registry)


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format: str, *args) -> None:  # a scrape every few seconds: no log line
        pass


class _ThreadingWSGIServer(ThreadingMixIn, WSGIServer):
    daemon_threads = True


class _ThreadingWSGIServer6(_ThreadingWSGIServer):
    address_family = socket.AF_INET6  # a pod IP on an IPv6 cluster


HEALTH_PATH = "/healthz"  # 200 while the server can take work (readiness)
LIVE_PATH = "/livez"  # 200 while the process answers at all (liveness, startup)


def serve_metrics(host: str, port: int, registry: CollectorRegistry,
                  ready: Callable[[], bool] | None = None) -> Callable[[], None] | None:
    """Expose ``registry`` on http://host:port/metrics, ``/healthz``: 200 while ``ready()``
    (the server's health is SERVING; None = alive is enough), else 503, and ``/livez``: 200
    while the process answers. Kubernetes probes
    read ``/healthz`` here because the gRPC ports require client certificates (mTLS) that
    the kubelet does not have. Returns a function that stops it (None when ``port`` is 0)."""
    if port == 0:
        return None
    metrics = make_wsgi_app(registry)

    def app(environ, start_response):
        path = environ.get("PATH_INFO")
        if path in (HEALTH_PATH, LIVE_PATH):
            ok = path == LIVE_PATH or ready is None or ready()
            start_response("200 OK" if ok else "503 Service Unavailable",
                           [("Content-Type", "text/plain")])
            return [b"ok\n" if ok else b"not serving\n"]
        return metrics(environ, start_response)

    server_class = _ThreadingWSGIServer6 if ":" in host else _ThreadingWSGIServer
    server = make_server(host.strip("[]"), port, app, server_class, handler_class=_QuietHandler)
    thread = threading.Thread(target=server.serve_forever, name="metrics", daemon=True)
    thread.start()
    log.info("metrics on http://%s:%d/metrics (and %s, %s)", host, port, HEALTH_PATH, LIVE_PATH)

    def stop() -> None:
        server.shutdown()
        server.server_close()
        thread.join()

    return stop
