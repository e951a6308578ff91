"""What the service did between two scrapes: rates, length distributions, latencies, load.

``observe(older, newer)`` subtracts counters and histograms pod by pod (a pod that
restarted in between counts from zero, as Prometheus' ``rate`` does; a pod that is new
counts whole) and reads gauges from the newer scrape. The result is the planner's only
view of the service:

    gateway   request rate, prompt and output length distributions, TTFT and ITL P90
    decode    per pod: sequences running (and streaming on average: by Little's law, the
              seconds of its token gaps over the interval's), queue, KV blocks, its ITL
    prefill   per chain: queued requests and tokens, prompt tokens and compute seconds spent
    (prefix cache hit rate, when the decode pods export it)

Histogram quantiles interpolate inside a bucket as Prometheus' ``histogram_quantile`` does.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from baton.planner.samples import ClusterScrape, PodScrape

# The series read here; tests check each against the definitions in baton.metrics.
GATEWAY_PROMPT_TOKENS = "baton_gateway_prompt_tokens"
GATEWAY_OUTPUT_TOKENS = "baton_gateway_output_tokens"
GATEWAY_TTFT = "baton_gateway_time_to_first_token_seconds"
GATEWAY_ITL = "baton_gateway_time_between_tokens_seconds"
DECODE_ITL = "baton_decode_time_between_tokens_seconds"
DECODE_RUNNING = "baton_decode_running_sequences"
DECODE_QUEUED = "baton_decode_queued_requests"
DECODE_KV_USED = "baton_decode_kv_blocks_used"
DECODE_KV_TOTAL = "baton_decode_kv_blocks_total"
PREFILL_QUEUED = "baton_prefill_queued_requests"
PREFILL_QUEUED_TOKENS = "baton_prefill_queued_prompt_tokens"
PREFILL_TOKENS = "baton_prefill_prompt_tokens_total"
PREFILL_COMPUTE = "baton_prefill_compute_seconds"
# Decode pods with a prefix cache export these; without them the hit rate is unknown.
PREFIX_HIT_TOKENS = "baton_decode_prefix_cache_hit_tokens_total"
PREFIX_QUERY_TOKENS = "baton_decode_prefix_cache_prompt_tokens_total"
PLANNER_SERIES = (GATEWAY_PROMPT_TOKENS, GATEWAY_OUTPUT_TOKENS, GATEWAY_TTFT, GATEWAY_ITL,
                  DECODE_ITL, DECODE_RUNNING, DECODE_QUEUED, DECODE_KV_USED, DECODE_KV_TOTAL,
                  PREFILL_QUEUED, PREFILL_QUEUED_TOKENS, PREFILL_TOKENS, PREFILL_COMPUTE,
                  PREFIX_HIT_TOKENS, PREFIX_QUERY_TOKENS)  # all of the above: what a trace keeps


@dataclass(frozen=True)
class Distribution:
    """A histogram's observations between two scrapes: counts per bucket (upper bounds,
    ascending, the last one +Inf), their sum and count. Observations are at least ``floor``
    (the first bucket's lower edge)."""

    bounds: tuple[float, ...] = ()
    counts: tuple[float, ...] = ()  # not cumulative: observations in (bounds[i-1], bounds[i]]
    total: float = 0.0
    count: float = 0.0
    floor: float = 0.0

    @property
    def mean(self) -> float:
        return self.total / self.count if self.count else 0.0

    def _edges(self):
        """(lower, upper, count) per bucket; +Inf's upper edge is taken as twice its lower."""
        lower = self.floor
        for bound, n in zip(self.bounds, self.counts):
            upper = max(lower, 1.0) * 2 if math.isinf(bound) else bound
            yield lower, upper, n
            lower = upper

    def quantile(self, q: float) -> float:
        """The q-quantile, linear inside its bucket as histogram_quantile does (0 when empty)."""
        if not self.count:
            return 0.0
        rank, seen = q * self.count, 0.0
        for lower, upper, n in self._edges():
            if n and seen + n >= rank:
                return lower + (upper - lower) * (rank - seen) / n
            seen += n
        return self.floor

    def moment(self, k: int) -> float:
        """E[x^k] from bucket midpoints."""
        if not self.count:
            return 0.0
        return sum(n * ((lower + upper) / 2) ** k for lower, upper, n in self._edges()) / self.count

    def above(self, threshold: float) -> Distribution:
        """The observations at or above ``threshold`` (a bucket it cuts counts pro rata);
        their total estimated from bucket midpoints."""
        bounds, counts = [], []
        for lower, upper, n in self._edges():
            if upper > threshold:
                share = 1.0 if lower >= threshold else (upper - threshold) / (upper - lower)
                bounds.append(upper)
                counts.append(n * share)
        part = Distribution(tuple(bounds), tuple(counts), 0.0, sum(counts),
                            floor=max(self.floor, threshold))
        return Distribution(part.bounds, part.counts, part.moment(1) * part.count, part.count,
                            part.floor)


def distribution(newer: PodScrape, older: PodScrape | None, name: str, **labels: str) -> Distribution:
    """``name``'s observations from ``older`` to ``newer`` (one pod)."""
    now = newer.buckets(name, **labels)
    before = older.buckets(name, **labels) if older is not None else {}
    total = newer.value(f"{name}_sum", **labels)
    count = newer.value(f"{name}_count", **labels)
    if older is not None and older.value(f"{name}_count", **labels) <= count:
        total -= older.value(f"{name}_sum", **labels)
        count -= older.value(f"{name}_count", **labels)
    else:
        before = {}  # restarted: its counters began again at zero
    bounds = tuple(sorted(now))
    cumulative = [now[b] - before.get(b, 0.0) for b in bounds]
    counts = tuple(max(0.0, c - p) for c, p in zip(cumulative, [0.0, *cumulative[:-1]]))
    return Distribution(bounds, counts, total, count)


def merge(parts: list[Distribution]) -> Distribution:
    parts = [p for p in parts if p.bounds]
    if not parts:
        return Distribution()
    bounds = parts[0].bounds
    counts = tuple(sum(p.counts[i] for p in parts) for i in range(len(bounds)))
    return Distribution(bounds, counts, sum(p.total for p in parts), sum(p.count for p in parts))


def counter_delta(newer: PodScrape, older: PodScrape | None, name: str, **labels: str) -> float:
    now = newer.value(name, **labels)
    if older is None:
        return now
    before = older.value(name, **labels)
    return now - before if now >= before else now


@dataclass(frozen=True)
class DecodePod:
    pod: str
    running_sequences: float  # the gauge at the newer scrape
    mean_sequences: float  # streaming at once over the interval: its token gaps' seconds / duration
    queued_requests: float
    kv_blocks_used: float
    kv_blocks_total: float
    itl: Distribution  # this pod's gaps between tokens
    whole_interval: bool  # it was scraped at the interval's start too (not new, not restarted)


@dataclass(frozen=True)
class Chain:
    chain: str
    queued_requests: float
    queued_prompt_tokens: float
    prompts: float  # prompts prefilled
    prompt_tokens: float  # their tokens
    compute_s: float  # the chain's compute seconds for them

    @property
    def idle(self) -> bool:
        return self.queued_requests == 0


@dataclass(frozen=True)
class Observation:
    """The service between two scrapes ``duration_s`` apart (see the module docstring)."""

    duration_s: float
    prompt_tokens: Distribution = field(default_factory=Distribution)
    output_tokens: Distribution = field(default_factory=Distribution)
    ttft: Distribution = field(default_factory=Distribution)
    itl: Distribution = field(default_factory=Distribution)
    decode: tuple[DecodePod, ...] = ()
    chains: tuple[Chain, ...] = ()
    prefix_hit_rate: float | None = None

    @property
    def request_rate_per_s(self) -> float:
        return self.prompt_tokens.count / self.duration_s if self.duration_s > 0 else 0.0

    @property
    def decode_queued(self) -> float:
        return sum(pod.queued_requests for pod in self.decode)


def observe(older: ClusterScrape, newer: ClusterScrape) -> Observation:
    """The service from ``older`` to ``newer`` (a later scrape)."""
    before = older.by_name()

    def prior(pod: PodScrape) -> PodScrape | None:
        return before.get(pod.pod)

    gateways = newer.of_role("gateway")
    duration_s = newer.time_s - older.time_s
    decode_pods = tuple(
        DecodePod(pod.pod,
                  running_sequences=pod.value(DECODE_RUNNING),
                  mean_sequences=distribution(pod, prior(pod), DECODE_ITL).total / duration_s,
                  queued_requests=pod.value(DECODE_QUEUED),
                  kv_blocks_used=pod.value(DECODE_KV_USED),
                  kv_blocks_total=pod.value(DECODE_KV_TOTAL),
                  itl=distribution(pod, prior(pod), DECODE_ITL),
                  whole_interval=prior(pod) is not None)
        for pod in newer.of_role("decode"))
    chains = []
    for chain, pods in newer.chains().items():
        compute = merge([distribution(p, prior(p), PREFILL_COMPUTE) for p in pods])
        chains.append(Chain(
            chain, queued_requests=sum(p.value(PREFILL_QUEUED) for p in pods),
            queued_prompt_tokens=sum(p.value(PREFILL_QUEUED_TOKENS) for p in pods),
            prompts=compute.count, compute_s=compute.total,
            prompt_tokens=sum(counter_delta(p, prior(p), PREFILL_TOKENS) for p in pods)))
    return Observation(
        duration_s=duration_s,
        prompt_tokens=merge([distribution(g, prior(g), GATEWAY_PROMPT_TOKENS) for g in gateways]),
        output_tokens=merge([distribution(g, prior(g), GATEWAY_OUTPUT_TOKENS) for g in gateways]),
        ttft=merge([distribution(g, prior(g), GATEWAY_TTFT) for g in gateways]),
        itl=merge([distribution(g, prior(g), GATEWAY_ITL) for g in gateways]),
        decode=decode_pods, chains=tuple(chains),
        prefix_hit_rate=_prefix_hit_rate(newer, prior))


def _prefix_hit_rate(newer: ClusterScrape, prior) -> float | None:
    pods = [p for p in newer.of_role("decode") if p.has(PREFIX_QUERY_TOKENS)]
    if not pods:
        return None
    queried = sum(counter_delta(p, prior(p), PREFIX_QUERY_TOKENS) for p in pods)
    hit = sum(counter_delta(p, prior(p), PREFIX_HIT_TOKENS) for p in pods)
    return hit / queried if queried > 0 else None
