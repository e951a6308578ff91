"""What ``baton up`` runs on one machine: the ``ClusterSpec`` of a ``LocalCluster``."""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from baton.config import (
    ChainConfig,
    GatewayRoutingConfig,
    KVCacheConfig,
    KVTransportConfig,
    LogConfig,
    OtlpConfig,
    PlannerConfig,
    ServerConfig,
    StreamConfig,
)

MAX_DECODE_WORKERS = 8


@dataclass
class ClusterSpec:
    model_path: str = ""  # empty = the shipped model
    served_model_names: list[str] = field(default_factory=list)  # empty = the directory's name
    model_revision: str = ""  # a repo id's branch, tag or commit
    max_model_len: int = 0  # 0 = the model's
    decode_workers: int = 1
    chain_ranks: int = ChainConfig.ranks  # 0 = no chain: every prompt is prefilled on a decode pod
    redis_url: str = ""  # empty = start a redis-server for this cluster
    gateway_listen: str = "127.0.0.1:0"
    gateway_http_port: int = 0  # the gateway's OpenAI HTTP API on 127.0.0.1 (0 = off)
    # every decode pod serves its own OpenAI door too (an InferencePool endpoint's), on a
    # free port of 127.0.0.1 (``LocalCluster.decode_http_url``)
    decode_http: bool = False
    prefill_threshold_tokens: int = GatewayRoutingConfig.prefill_threshold_tokens
    # The gateway's chain_break_even: a chain takes only prompts from the length its partition
    # table measured it to pay (on one small machine that is past the shipped model's context,
    # so prompts stay on the decode pod unless pinned); False = the threshold alone decides.
    chain_break_even: bool = GatewayRoutingConfig.chain_break_even
    threads_per_process: int = 1  # torch threads of every chain rank
    # torch threads of each decode pod; 0 = this machine's cores shared among the decode pods.
    # A decode pod works through every phase of every request (it prefills the short prompts,
    # decodes all of them) while a chain works only on long prompts, so on a small machine
    # the pod gets the cores: one thread left it using half of a 2-core machine whenever the
    # chain was idle.
    decode_threads: int = 0
    stream_interval_ms: float = StreamConfig.interval_ms  # the decode pods' --stream-interval-ms
    mtls: bool = True  # a private CA and a certificate per role; False: --mtls-insecure
    heartbeat_s: float = 0.5
    worker_ttl_s: float = 2.0
    # more flags per role, e.g. {"decode": ["--pyramid-enabled", "false"]}
    extra_args: dict[str, list[str]] = field(default_factory=dict)
    # The planner's settings when the decode pods are autoscaled (decode_workers is then the
    # count to start with); None = they stay as decode_workers made them.
    autoscale: PlannerConfig | None = None
    decode_grace_s: float = ServerConfig.grace_s  # a decode pod's streams' time after SIGTERM
    kv_transport: str = KVTransportConfig.kind  # the chain's and the decode pods' --kv-transport-kind
    kv_cache: KVCacheConfig = field(default_factory=KVCacheConfig)  # their KV's bytes (FP8 or not)
    # each decode pod's model sharded over this many processes (its threads shared among them)
    decode_tensor_parallel_size: int = 1
    prefill_tensor_parallel_size: int = 1  # each chain rank's, likewise (the chain ships every head)
    log: LogConfig = field(default_factory=LogConfig)  # every process's logs
    otlp: OtlpConfig = field(default_factory=OtlpConfig)  # and traces

    def threads_of(self, role: str) -> int:
        """Torch threads of one process of ``role`` (the gateway runs no torch work)."""
        if role != "decode":
            return self.threads_per_process  # each rank of a sharded chain rank too
        if self.decode_threads:
            return self.decode_threads
        most = self.autoscale.max_decode_pods if self.autoscale else self.decode_workers
        return max(1, len(os.sched_getaffinity(0)) // (most * self.decode_tensor_parallel_size))

    def __post_init__(self) -> None:
        for role in ("decode", "prefill"):
            size = getattr(self, f"{role}_tensor_parallel_size")
            if size < 1:
                raise ValueError(f"{role}_tensor_parallel_size must be >= 1, got {size}")
        if not 1 <= self.decode_workers <= MAX_DECODE_WORKERS:
            raise ValueError(f"decode_workers must be in 1..{MAX_DECODE_WORKERS}, got "
                             f"{self.decode_workers}")
        if self.autoscale is not None:
            low, high = self.autoscale.min_decode_pods, self.autoscale.max_decode_pods
            if high > MAX_DECODE_WORKERS or not low <= self.decode_workers <= high:
                raise ValueError(f"autoscaled decode pods need min ({low}) <= decode_workers "
                                 f"({self.decode_workers}) <= max ({high}) <= "
                                 f"{MAX_DECODE_WORKERS} on one machine")
        ServerConfig(grace_s=self.decode_grace_s)  # a bad value fails before any process
        if self.chain_ranks < 0:
            raise ValueError(f"chain_ranks must be >= 0, got {self.chain_ranks}")
        if self.threads_per_process < 1 or self.decode_threads < 0:
            raise ValueError(f"threads_per_process must be >= 1 and decode_threads >= 0 "
                             f"(0 = automatic), got {self.threads_per_process} and "
                             f"{self.decode_threads}")
        StreamConfig(interval_ms=self.stream_interval_ms)  # a bad value fails before any process
        KVTransportConfig(kind=self.kv_transport)
