"""baton's one configuration tree.

Every knob of every engine and service is a field here, with its help text, its
choices and bounds (checked by ``@settings``) and its remaining validation. CLI flags
(``--scheduler-token-budget``), environment variables (``BATON_SCHEDULER_TOKEN_BUDGET``),
the operator's container arguments, the CRD's schema and the Helm values all derive from
these names (see ``baton.configtree`` and ``baton_operator.schema``). The families of
swappable parts are declared here too (``baton.registry``), so a setting's choices are
known without loading any engine.

One module per role: model and KV pool, scheduler and PyramidInfer, chain and KV
transport, serving (server, streams, routing store, mTLS, HTTP, keys), logs and traces, gateway routing,
planner, training; ``services`` assembles each service's tree.
"""

from baton.config.chain import (
    CHAIN_BACKENDS,
    KV_SHIPPING,
    KV_TRANSPORTS,
    RUNAHEAD_MODES,
    ChainConfig,
    KVTransportConfig,
)
from baton.config.gateway import CHAIN_FAILURE_POLICIES, GATEWAY_POLICIES, GatewayRoutingConfig
from baton.config.model import DEVICES, DTYPES, KVCacheConfig, KVPoolConfig, ModelSourceConfig
from baton.config.observability import LOG_FORMATS, LOG_LEVELS, LogConfig, OtlpConfig
from baton.config.parallel import TensorParallelConfig
from baton.config.planner import PlannerConfig
from baton.config.scheduler import (
    PYRAMID_POLICIES,
    SCHEDULER_POLICIES,
    PyramidConfig,
    SchedulerConfig,
)
from baton.config.services import DecodeServiceConfig, GatewayServiceConfig, PrefillServiceConfig
from baton.config.serving import (
    AuthConfig,
    DecodeHttpConfig,
    HttpConfig,
    MtlsConfig,
    RoutingConfig,
    ServerConfig,
    StreamConfig,
)
from baton.config.train import TrainConfig

__all__ = [
    "CHAIN_BACKENDS", "CHAIN_FAILURE_POLICIES", "DEVICES", "DTYPES", "GATEWAY_POLICIES",
    "KV_SHIPPING", "KV_TRANSPORTS", "LOG_FORMATS", "LOG_LEVELS", "PYRAMID_POLICIES", "RUNAHEAD_MODES", "SCHEDULER_POLICIES",
    "AuthConfig", "ChainConfig", "DecodeHttpConfig", "DecodeServiceConfig", "GatewayRoutingConfig",
    "GatewayServiceConfig", "HttpConfig", "KVCacheConfig", "KVPoolConfig", "KVTransportConfig", "LogConfig",
    "ModelSourceConfig",
    "MtlsConfig", "OtlpConfig", "PlannerConfig", "PrefillServiceConfig", "PyramidConfig", "RoutingConfig",
    "SchedulerConfig", "ServerConfig", "StreamConfig", "TensorParallelConfig", "TrainConfig",
]
