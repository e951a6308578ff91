"""Each service's whole configuration: the sections its flags come from."""

from __future__ import annotations

from dataclasses import dataclass, field

from baton.config.chain import ChainConfig, KVTransportConfig
from baton.config.gateway import GatewayRoutingConfig
from baton.config.model import KVCacheConfig, KVPoolConfig, ModelSourceConfig
from baton.config.observability import LogConfig, OtlpConfig
from baton.config.parallel import TensorParallelConfig
from baton.config.scheduler import PyramidConfig, SchedulerConfig
from baton.config.serving import (
    AuthConfig,
    DecodeHttpConfig,
    HttpConfig,
    MtlsConfig,
    RoutingConfig,
    ServerConfig,
    StreamConfig,
)


@dataclass
class DecodeServiceConfig:
    """`baton decode`: a SARATHI decode worker."""

    server: ServerConfig = field(default_factory=ServerConfig)
    stream: StreamConfig = field(default_factory=StreamConfig)
    model: ModelSourceConfig = field(default_factory=ModelSourceConfig)
    tensor_parallel: TensorParallelConfig = field(default_factory=TensorParallelConfig)
    kv: KVPoolConfig = field(default_factory=KVPoolConfig)
    kv_cache: KVCacheConfig = field(default_factory=KVCacheConfig)
    kv_transport: KVTransportConfig = field(default_factory=KVTransportConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    pyramid: PyramidConfig = field(default_factory=PyramidConfig)
    routing: RoutingConfig = field(default_factory=RoutingConfig)
    mtls: MtlsConfig = field(default_factory=MtlsConfig)
    log: LogConfig = field(default_factory=LogConfig)
    otlp: OtlpConfig = field(default_factory=OtlpConfig)
    # The pod's own OpenAI door (an InferencePool endpoint): it routes as the gateway does
    # (``gateway``: policy, threshold, chain failures) among itself and the chains, and
    # takes the gateway's API keys (``auth``).
    http: DecodeHttpConfig = field(default_factory=DecodeHttpConfig)
    gateway: GatewayRoutingConfig = field(default_factory=GatewayRoutingConfig)
    auth: AuthConfig = field(default_factory=AuthConfig)


@dataclass
class PrefillServiceConfig:
    """`baton prefill`: one rank of a KV-Runahead prefill chain."""

    server: ServerConfig = field(default_factory=ServerConfig)
    model: ModelSourceConfig = field(default_factory=ModelSourceConfig)
    tensor_parallel: TensorParallelConfig = field(default_factory=TensorParallelConfig)
    chain: ChainConfig = field(default_factory=ChainConfig)
    kv_cache: KVCacheConfig = field(default_factory=KVCacheConfig)
    kv_transport: KVTransportConfig = field(default_factory=KVTransportConfig)
    pyramid: PyramidConfig = field(default_factory=PyramidConfig)
    routing: RoutingConfig = field(default_factory=RoutingConfig)
    mtls: MtlsConfig = field(default_factory=MtlsConfig)
    log: LogConfig = field(default_factory=LogConfig)
    otlp: OtlpConfig = field(default_factory=OtlpConfig)


@dataclass
class GatewayServiceConfig:
    """`baton gateway`: the client-facing router."""

    server: ServerConfig = field(default_factory=ServerConfig)
    model: ModelSourceConfig = field(default_factory=ModelSourceConfig)
    gateway: GatewayRoutingConfig = field(default_factory=GatewayRoutingConfig)
    routing: RoutingConfig = field(default_factory=RoutingConfig)
    http: HttpConfig = field(default_factory=HttpConfig)
    auth: AuthConfig = field(default_factory=AuthConfig)
    mtls: MtlsConfig = field(default_factory=MtlsConfig)
    log: LogConfig = field(default_factory=LogConfig)
    otlp: OtlpConfig = field(default_factory=OtlpConfig)
