"""A simulated baton whose pods export their real metric classes (baton.metrics), for the
planner's tests: a load trace in, one ClusterScrape per interval out.

The simulated truth the planner must discover by fitting (never told to it):

    decode pod   ITL = ITL_BASE_S + ITL_PER_SEQUENCE_S * sequences running on it
                 sequences from Little's law (rate x output tokens x ITL, solved for ITL)
    chain        compute = PREFILL_BASE_S + PREFILL_PER_TOKEN_S * prompt tokens; each chain a
                 queue (Pollaczek-Khinchine mean wait, exponential spread)

Each interval's lengths are drawn from a seeded generator; every new pod starts with fresh
counters, as a restarted process does.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable
from dataclasses import dataclass, field

from baton.metrics import DecodeMetrics, GatewayMetrics, PrefillMetrics
from baton.planner import ClusterScrape, Planner, Replicas, parse_pod
from prometheus_client import CollectorRegistry, generate_latest

ITL_BASE_S = 0.02
ITL_PER_SEQUENCE_S = 0.006
PREFILL_BASE_S = 0.05
PREFILL_PER_TOKEN_S = 0.0004
LOCAL_PREFILL_PER_TOKEN_S = 0.0008
KV_BLOCKS = 4000
BLOCK_TOKENS = 16
MAX_RUNNING = 64
SAMPLES_PER_POD = 60  # token gaps the gateway observes per interval (enough for a P90)
SPREAD = tuple(0.8 + 0.4 * i / 19 for i in range(20))  # a gap is ITL x U(0.8, 1.2)
THRESHOLD = 512


def _observe_many(histogram, value: float, count: float) -> None:
    """``count`` observations of ``value`` at once (prometheus_client's own fields: observing
    thousands of gaps one by one would make every test interval slow)."""
    histogram._sum.inc(value * count)
    index = next(i for i, bound in enumerate(histogram._upper_bounds) if value <= bound)
    histogram._buckets[index].inc(count)


@dataclass(frozen=True)
class Load:
    rate_per_s: float
    prompt_tokens: tuple[int, int]  # uniform range
    output_tokens: tuple[int, int]


@dataclass
class _Pod:
    name: str
    role: str
    chain: str = ""
    registry: CollectorRegistry = field(default_factory=CollectorRegistry)

    def __post_init__(self) -> None:
        kind = {"gateway": GatewayMetrics, "decode": DecodeMetrics, "prefill": PrefillMetrics}
        self.metrics = kind[self.role](self.registry, "simulated")


class SimulatedService:
    def __init__(self, replicas: Replicas, seed: int = 0) -> None:
        self.random = random.Random(seed)
        self.gateway = _Pod("gateway-0", "gateway")
        self.decode: list[_Pod] = []
        self.chains: list[_Pod] = []
        self._serial = 0
        self.resize(replicas)
        self.time_s = 0.0

    @property
    def replicas(self) -> Replicas:
        return Replicas(len(self.chains), len(self.decode))

    def resize(self, replicas: Replicas) -> None:
        while len(self.decode) < replicas.decode_pods:
            self._serial += 1
            self.decode.append(_Pod(f"decode-{self._serial}", "decode"))
        del self.decode[replicas.decode_pods:]
        while len(self.chains) < replicas.prefill_chains:
            index = len(self.chains)
            self.chains.append(_Pod(f"prefill-{index}-{self._serial}", "prefill", f"chain-{index}"))
            self._serial += 1
        del self.chains[replicas.prefill_chains:]

    def scrape(self) -> ClusterScrape:
        pods = [self.gateway, *self.decode, *self.chains]
        return ClusterScrape(self.time_s, tuple(
            parse_pod(p.name, p.role, generate_latest(p.registry).decode(), p.chain) for p in pods))

    def run_interval(self, load: Load, duration_s: float) -> None:
        """Serve ``load`` for ``duration_s`` and record what the pods' metrics would."""
        self.time_s += duration_s
        self.interval_s = duration_s
        num = max(0, round(load.rate_per_s * duration_s))
        prompts = [self.random.randint(*load.prompt_tokens) for _ in range(num)]
        outputs = [self.random.randint(*load.output_tokens) for _ in range(num)]
        gateway: GatewayMetrics = self.gateway.metrics
        for prompt, output in zip(prompts, outputs):
            gateway.record_lengths(prompt, output)
        itl_s = self._decode(load.rate_per_s, outputs, prompts)
        long = [p for p in prompts if p >= THRESHOLD]
        short = [p for p in prompts if p < THRESHOLD]
        for prompt in short:
            gateway.ttft_s.labels(path="local").observe(
                prompt * LOCAL_PREFILL_PER_TOKEN_S + itl_s * self.random.uniform(0.8, 1.2))
        self._prefill(long, duration_s)
        for _ in range(SAMPLES_PER_POD):
            gateway.time_between_tokens_s.observe(itl_s * self.random.uniform(0.8, 1.2))

    def _decode(self, rate: float, outputs: list[int], prompts: list[int]) -> float:
        num_pods = len(self.decode)
        mean_output = sum(outputs) / len(outputs) if outputs else 0.0
        demand = rate * mean_output  # tokens per second
        capacity = num_pods * 1 / ITL_PER_SEQUENCE_S
        if demand and demand < capacity:
            per_pod = demand * ITL_BASE_S / (num_pods - demand * ITL_PER_SEQUENCE_S)
            per_pod = min(per_pod, MAX_RUNNING)
            queued = 0.0
        else:  # saturated: the excess waits for admission
            per_pod = MAX_RUNNING if demand else 0.0
            queued = (rate - capacity / mean_output) * self.interval_s if demand else 0.0
        itl_s = ITL_BASE_S + ITL_PER_SEQUENCE_S * per_pod
        mean_prompt = sum(prompts) / len(prompts) if prompts else 0.0
        for pod in self.decode:
            metrics: DecodeMetrics = pod.metrics
            metrics.running_sequences.set(per_pod)
            metrics.queued_requests.set(queued / num_pods)
            metrics.kv_blocks_total.set(KV_BLOCKS)
            metrics.kv_blocks_used.set(min(KV_BLOCKS, per_pod * (mean_prompt + mean_output / 2)
                                           / BLOCK_TOKENS))
            if per_pod:  # per_pod sequences streaming a token every itl_s over the interval
                gaps = per_pod * self.interval_s / itl_s
                for factor in SPREAD:
                    _observe_many(metrics.time_between_tokens_s, itl_s * factor, gaps / len(SPREAD))
        return itl_s

    def _prefill(self, long: list[int], duration_s: float) -> None:
        gateway: GatewayMetrics = self.gateway.metrics
        if not long:
            for chain in self.chains:
                chain.metrics.queued_requests.set(0)
                chain.metrics.queued_prompt_tokens.set(0)
            return
        if not self.chains:
            for _prompt in long:  # the gateway prefills them on decode pods, slowly
                gateway.ttft_s.labels(path="local").observe(_prompt * LOCAL_PREFILL_PER_TOKEN_S * 4)
            return
        services = [PREFILL_BASE_S + PREFILL_PER_TOKEN_S * p for p in long]
        mean_s = sum(services) / len(services)
        second = sum(s * s for s in services) / len(services)
        rate = len(long) / duration_s / len(self.chains)
        busy = rate * mean_s
        wait_s = rate * second / (2 * (1 - busy)) if busy < 1 else duration_s * (busy - 1)
        for index, (prompt, service_s) in enumerate(zip(long, services)):
            chain: PrefillMetrics = self.chains[index % len(self.chains)].metrics
            chain.record_prefill(prompt, service_s)
            gateway.ttft_s.labels(path="chain").observe(
                service_s + self.random.expovariate(1 / wait_s) if wait_s > 0 else service_s)
        for chain in self.chains:
            queued = max(0.0, busy - 1) * rate * duration_s if busy >= 1 else 0.0
            chain.metrics.queued_requests.set(math.floor(queued))
            chain.metrics.queued_prompt_tokens.set(math.floor(queued) * sum(long) / len(long))


@dataclass(frozen=True)
class Step:
    time_s: float
    replicas: Replicas  # after this step's decision
    reasons: tuple[str, str]


def run(trace: Callable[[float], Load], planner: Planner, service: SimulatedService,
        duration_s: float, clock: list[float]) -> list[Step]:
    """Every ``planner.config.interval_s``: serve, scrape, decide, apply at once."""
    interval = planner.config.interval_s
    steps = []
    planner.observe(service.scrape())
    while service.time_s < duration_s:
        service.run_interval(trace(service.time_s), interval)
        clock[0] = service.time_s
        planner.observe(service.scrape())
        decision = planner.decide(service.replicas)
        service.resize(decision.target)
        steps.append(Step(service.time_s, decision.target,
                          (decision.prefill.reason, decision.decode.reason)))
    return steps
