"""The series vLLM exports, under vLLM's names, for what baton measures alike.

The Gateway API Inference Extension's endpoint picker, KEDA and HPA recipes and community
dashboards read these names; baton's own ``baton_*`` series (``baton.metrics``) stay for what
vLLM has no name for. Names, types, label names and bucket boundaries are vLLM v1's
(``vllm/v1/metrics/loggers.py``): every series carries ``model_name`` (the served model name)
and ``engine`` ("0": one engine per pod), and counters are declared without ``_total``, which
the client library appends.

Each request is observed once in a fleet: a decode pod observes every request it serves,
except the request-level latencies (time to first token, end to end) of a request whose KV a
chain pushed, which only the gateway saw arrive (``VllmRequestLatencies`` on both).
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

LABELS = ("model_name", "engine")
ENGINE = "0"  # vLLM numbers its data-parallel engines; a baton pod runs one

TTFT_BUCKETS_S = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5,
                  5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
INTER_TOKEN_BUCKETS_S = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5,
                         5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
REQUEST_LATENCY_BUCKETS_S = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0,
                             40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
# vLLM's FinishReason strings that baton produces ("error": a stream the engine failed).
FINISHED_REASONS = ("stop", "length", "abort", "error")


class VllmRequestLatencies:
    """Time to first token and end-to-end latency, from the request's arrival where it is
    observed (vLLM: arrival at the engine's front end)."""

    def __init__(self, registry: CollectorRegistry, model_name: str) -> None:
        labels = (model_name, ENGINE)
        self.ttft_s = Histogram(
            "vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.",
            LABELS, buckets=TTFT_BUCKETS_S, registry=registry).labels(*labels)
        self.e2e_s = Histogram(
            "vllm:e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.",
            LABELS, buckets=REQUEST_LATENCY_BUCKETS_S, registry=registry).labels(*labels)


class VllmEngineMetrics:
    """A decode pod's engine: its scheduler's queues, its KV pool, its tokens and requests."""

    def __init__(self, registry: CollectorRegistry, model_name: str) -> None:
        self.registry = registry
        labels = (model_name, ENGINE)
        self.latencies = VllmRequestLatencies(registry, model_name)
        self.num_requests_running = Gauge(
            "vllm:num_requests_running", "Number of requests in model execution batches.",
            LABELS, registry=registry).labels(*labels)
        self.num_requests_waiting = Gauge(
            "vllm:num_requests_waiting", "Number of requests waiting to be processed.",
            LABELS, registry=registry).labels(*labels)
        self.kv_cache_usage = Gauge(
            "vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.",
            LABELS, registry=registry).labels(*labels)
        self.prefix_cache_queries = Counter(
            "vllm:prefix_cache_queries", "Prefix cache queries, in terms of number of queried "
            "tokens.", LABELS, registry=registry).labels(*labels)
        self.prefix_cache_hits = Counter(
            "vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens.",
            LABELS, registry=registry).labels(*labels)
        self.num_preemptions = Counter(
            "vllm:num_preemptions", "Cumulative number of preemption from the engine.",
            LABELS, registry=registry).labels(*labels)
        self.prompt_tokens = prompt_tokens_counter(registry, model_name)
        self.generation_tokens = Counter(
            "vllm:generation_tokens", "Number of generation tokens processed.",
            LABELS, registry=registry).labels(*labels)
        request_success = Counter(
            "vllm:request_success", "Count of successfully processed requests.",
            LABELS + ("finished_reason",), registry=registry)
        self.request_success = {reason: request_success.labels(*labels, reason)
                                for reason in FINISHED_REASONS}
        self.inter_token_latency_s = Histogram(
            "vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.",
            LABELS, buckets=INTER_TOKEN_BUCKETS_S, registry=registry).labels(*labels)
        self.request_queue_time_s = Histogram(
            "vllm:request_queue_time_seconds", "Histogram of time spent in WAITING phase for "
            "request.", LABELS, buckets=REQUEST_LATENCY_BUCKETS_S, registry=registry).labels(*labels)
        self._cache_config_info = Gauge(
            "vllm:cache_config_info", "Information of the LLMEngine CacheConfig",
            ("block_size", "enable_prefix_caching", "engine", "num_gpu_blocks"), registry=registry)
        self._seen = {"preemptions": 0, "prefix_queries": 0, "prefix_hits": 0}

    def record_cache_config(self, block_size: int, num_gpu_blocks: int,
                            enable_prefix_caching: bool) -> None:
        """vLLM's info-style gauge (always 1; the values are its labels, as ``str()`` writes
        them). ``num_gpu_blocks`` counts vLLM's blocks: ``block_size`` tokens of every layer."""
        self._cache_config_info.labels(block_size=str(block_size),
                                       enable_prefix_caching=str(enable_prefix_caching),
                                       engine=ENGINE, num_gpu_blocks=str(num_gpu_blocks)).set(1)

    def record_scheduler(self, num_waiting: int, num_running: int, kv_cache_usage: float,
                         num_preemptions: int) -> None:
        """After an engine step: the queues, the pool's used fraction and the engine's
        preemptions since it started."""
        self.num_requests_waiting.set(num_waiting)
        self.num_requests_running.set(num_running)
        self.kv_cache_usage.set(kv_cache_usage)
        self._advance(self.num_preemptions, "preemptions", num_preemptions)

    def record_prefix_cache(self, tokens_looked_up: int, tokens_hit: int) -> None:
        """The prefix cache's token counts since the pool started."""
        self._advance(self.prefix_cache_queries, "prefix_queries", tokens_looked_up)
        self._advance(self.prefix_cache_hits, "prefix_hits", tokens_hit)

    def record_finished(self, reason: str) -> None:
        self.request_success[reason].inc()

    def _advance(self, counter, name: str, total: int) -> None:
        """Bring a counter up to a running total kept elsewhere."""
        counter.inc(total - self._seen[name])
        self._seen[name] = total


def prompt_tokens_counter(registry: CollectorRegistry, model_name: str):
    """Prompt tokens prefilled, counted where the prefill completes (a decode pod's own
    prefills, a chain's tail for a chain's): vLLM counts each prompt whole once."""
    return Counter("vllm:prompt_tokens", "Number of prefill tokens processed.", LABELS,
                   registry=registry).labels(model_name, ENGINE)
