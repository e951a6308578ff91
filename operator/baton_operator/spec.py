"""A `BatonService` custom resource's spec, read into typed values and checked.

The CRD's OpenAPI schema rejects most bad input at the API server, but the
operator never relies on it alone: an object written before a schema change,
or by a client that skips validation, must still end in a `Degraded`
condition that names the bad value, never in a crash loop. Every engine
setting is checked by building the very configuration dataclasses the
services validate themselves with (`baton.config`), so the operator and the
services cannot disagree about what is valid. Which spec key holds which
setting is one table (``baton_operator.fields``), from which the CRD's schema is
generated too.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from baton.config import (
    ChainConfig,
    GatewayRoutingConfig,
    HttpConfig,
    KVCacheConfig,
    KVPoolConfig,
    KVTransportConfig,
    LogConfig,
    ModelSourceConfig,
    OtlpConfig,
    PlannerConfig,
    PyramidConfig,
    SchedulerConfig,
    StreamConfig,
    TensorParallelConfig,
)

from baton_operator import disruption_budgets, pod_overlay
from baton_operator.disruption_budgets import DisruptionBudget
from baton_operator.model_source import ModelSource, parse_uri
from baton_operator.mtls_spec import MtlsSpec, read_mtls
from baton_operator.pod_overlay import PodOverlay
from baton_operator.spec_reading import (
    SECRET_KEY,
    InvalidSpec,
    count_of,
    section_of,
    settings_of,
    values_of,
)

REDIS_MODES = ("managed", "external")
SERVICE_TYPES = ("ClusterIP", "NodePort", "LoadBalancer")


@dataclass(frozen=True)
class RedisSpec:
    mode: str = "managed"
    image: str = "redis:7.4-alpine"
    secret_name: str = ""  # external: the Secret holding the URL, and its key
    secret_key: str = "url"


@dataclass(frozen=True)
class GatewaySpec:
    replicas: int = 1
    service_type: str = "ClusterIP"
    tls_secret_name: str = ""
    api_keys_secret_name: str = ""  # a Secret holding the API keys file, and its key
    api_keys_secret_key: str = "keys"
    http: HttpConfig = field(default_factory=HttpConfig)  # port 0 = the HTTP API is off
    routing: GatewayRoutingConfig = field(default_factory=GatewayRoutingConfig)
    resources: dict = field(default_factory=dict)


@dataclass(frozen=True)
class PrefillSpec:
    chains: int = 1
    chain: ChainConfig = field(default_factory=ChainConfig)  # ranks and mode; rank comes per pod
    partition_table: str = ""  # JSON text shipped in a ConfigMap; empty = the image's default
    max_model_len: int = 0  # the chains' own limit; 0 = spec.model's
    tensor_parallel: TensorParallelConfig = field(default_factory=TensorParallelConfig)
    resources: dict = field(default_factory=dict)


@dataclass(frozen=True)
class DecodeSpec:
    replicas: int = 1
    kv: KVPoolConfig = field(default_factory=KVPoolConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    stream: StreamConfig = field(default_factory=StreamConfig)
    tensor_parallel: TensorParallelConfig = field(default_factory=TensorParallelConfig)
    max_model_len: int = 0  # the decode pods' own limit; 0 = spec.model's
    # each pod's own OpenAI door (an InferencePool endpoint); port 0 = off, the default
    http: HttpConfig = field(default_factory=lambda: HttpConfig(port=0))
    resources: dict = field(default_factory=dict)


@dataclass(frozen=True)
class AutoscalingSpec:
    """``spec.autoscaling``: the planner's targets and bounds (off: the pools keep the size
    they are given, by the spec or ``kubectl scale``)."""

    enabled: bool = False
    planner: PlannerConfig = field(default_factory=PlannerConfig)


@dataclass(frozen=True)
class GPUSpec:
    per_pod: int = 0
    resource_name: str = "nvidia.com/gpu"
    nccl_env: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class ServiceSpec:
    image: str
    image_pull_policy: str
    model: ModelSource
    prefill: PrefillSpec
    decode: DecodeSpec
    pyramid: PyramidConfig
    redis: RedisSpec
    gateway: GatewaySpec
    gpu: GPUSpec
    mtls: MtlsSpec
    autoscaling: AutoscalingSpec
    # Per role (gateway, redis, prefill, decode): scheduling and overlay, disruption budget.
    pods: dict[str, PodOverlay]
    disruption_budgets: dict[str, DisruptionBudget]
    image_pull_secrets: list[str] = field(default_factory=list)  # on every pod
    # The data plane of pushed KV, on the chains' tails and the decode pods alike.
    kv_transport: KVTransportConfig = field(default_factory=KVTransportConfig)
    # What the KV cache's bytes are, on the chains and the decode pods alike (FP8 or not).
    kv_cache: KVCacheConfig = field(default_factory=KVCacheConfig)
    # UCX_* variables of the chains' ranks and the decode pods (NIXL's UCX reads them).
    ucx_env: dict[str, str] = field(default_factory=dict)
    log: LogConfig = field(default_factory=LogConfig)  # every pod's logs
    otlp: OtlpConfig = field(default_factory=OtlpConfig)  # and traces


def _read_model(spec: dict) -> ModelSource:
    """``spec.model``: the URI (``baton_operator.model_source``) and the model's settings."""
    model = section_of(spec, "model")
    if "source" in model:  # written before the URI replaced it
        raise InvalidSpec("spec.model.source is no longer read: give spec.model.uri "
                          "(pvc://claim/path, host:///directory or hf://org/name@revision)")
    uri = model.get("uri") or ""
    if not isinstance(uri, str):
        raise InvalidSpec(f"spec.model.uri must be a string, got {uri!r}")
    try:
        scheme, location, sub_path, revision = parse_uri(uri.strip())
    except ValueError as e:
        raise InvalidSpec(f"spec.model.uri {uri!r}: {e}") from e
    config = settings_of(spec, "model", ModelSourceConfig, section="model")
    if revision and config.revision not in ("", revision):
        raise InvalidSpec(f"spec.model.uri asks for revision {revision!r} but "
                          f"spec.model.revision is {config.revision!r}: give one")
    if revision:
        config = dataclasses.replace(config, revision=revision)
    token = model.get("tokenSecret") or {}
    cache = model.get("cache") or {}
    offline = model.get("offline", False)
    if not isinstance(offline, bool):
        raise InvalidSpec(f"spec.model.offline must be true or false, got {offline!r}")
    if scheme != "hf" and (token or cache or offline):
        raise InvalidSpec("spec.model.tokenSecret, cache and offline apply to an hf:// "
                          f"spec.model.uri only, got {uri!r}")
    if token and not token.get("name"):
        raise InvalidSpec("spec.model.tokenSecret.name is required: the Secret holding HF_TOKEN")
    token_key = token.get("key") or ModelSource.token_secret_key
    if not SECRET_KEY.fullmatch(token_key):
        raise InvalidSpec(f"spec.model.tokenSecret.key {token_key!r} is not a Secret key")
    return ModelSource(scheme=scheme, location=location, sub_path=sub_path,
                       token_secret_name=token.get("name", ""), token_secret_key=token_key,
                       cache_claim_name=cache.get("claimName", ""),
                       cache_size_limit=str(cache.get("sizeLimit", "")), offline=offline,
                       config=config)


def _max_model_len(spec: dict, role: str) -> int:
    """``spec.<role>.maxModelLen``, checked as ``model.max_model_len`` is."""
    return settings_of(spec, role, ModelSourceConfig, section=role).max_model_len


def _read_redis(spec: dict) -> RedisSpec:
    redis = section_of(spec, "redis")
    mode = redis.get("mode", RedisSpec.mode)
    if mode not in REDIS_MODES:
        raise InvalidSpec(f"spec.redis.mode {mode!r} is not one of {REDIS_MODES}")
    secret = (redis.get("external") or {}).get("urlSecretRef") or {}
    if mode == "external" and not secret.get("name"):
        raise InvalidSpec("spec.redis.mode is external but spec.redis.external.urlSecretRef.name "
                          "is empty: name the Secret that holds the Redis URL")
    return RedisSpec(mode=mode, image=redis.get("image", RedisSpec.image),
                     secret_name=secret.get("name", ""),
                     secret_key=secret.get("key", RedisSpec.secret_key))


def _read_prefill(spec: dict) -> PrefillSpec:
    prefill = section_of(spec, "prefill")
    chain = settings_of(spec, "prefill", ChainConfig)
    return PrefillSpec(chains=count_of(prefill, "prefill", "chains", PrefillSpec.chains),
                       chain=chain, partition_table=prefill.get("partitionTable", ""),
                       max_model_len=_max_model_len(spec, "prefill"),
                       tensor_parallel=settings_of(spec, "prefill", TensorParallelConfig, section="prefill"),
                       resources=prefill.get("resources") or {})


def _read_decode(spec: dict) -> DecodeSpec:
    decode = section_of(spec, "decode")
    return DecodeSpec(
        replicas=count_of(decode, "decode", "replicas", DecodeSpec.replicas),
        kv=settings_of(spec, "decode", KVPoolConfig),
        scheduler=settings_of(spec, "decode", SchedulerConfig),
        stream=settings_of(spec, "decode", StreamConfig),
        tensor_parallel=settings_of(spec, "decode", TensorParallelConfig, section="decode"),
        max_model_len=_max_model_len(spec, "decode"),
        http=_read_http(spec, "decode", enabled=False),
        resources=decode.get("resources") or {})


def _read_http(spec: dict, role: str, enabled: bool) -> HttpConfig:
    """``spec.<role>.http``: its port, or port 0 unless ``enabled`` (the role's default)."""
    http = section_of(spec, role).get("http") or {}
    enabled = http.get("enabled", enabled)
    if not isinstance(enabled, bool):
        raise InvalidSpec(f"spec.{role}.http.enabled must be true or false, got {enabled!r}")
    where = f"{role}.http"
    count_of(http, where, "port", HttpConfig.port, minimum=1)  # 0 is `enabled: false`
    config = settings_of(spec, where, HttpConfig, section=where)
    return config if enabled else dataclasses.replace(config, port=0)


def _read_gateway(spec: dict) -> GatewaySpec:
    gateway = section_of(spec, "gateway")
    service_type = gateway.get("serviceType", GatewaySpec.service_type)
    if service_type not in SERVICE_TYPES:
        raise InvalidSpec(f"spec.gateway.serviceType {service_type!r} is not one of {SERVICE_TYPES}")
    api_keys = gateway.get("apiKeys") or {}
    api_keys_key = api_keys.get("key", GatewaySpec.api_keys_secret_key)
    if not isinstance(api_keys_key, str) or not SECRET_KEY.fullmatch(api_keys_key):
        raise InvalidSpec(f"spec.gateway.apiKeys.key {api_keys_key!r} is not a Secret key "
                          f"(letters, digits, '-', '_' and '.')")
    return GatewaySpec(
        replicas=count_of(gateway, "gateway", "replicas", GatewaySpec.replicas, minimum=1),
        service_type=service_type,
        tls_secret_name=(gateway.get("tls") or {}).get("secretName", ""),
        api_keys_secret_name=api_keys.get("secretName", ""),
        api_keys_secret_key=api_keys_key,
        http=_read_http(spec, "gateway", enabled=True),
        routing=settings_of(spec, "routing", GatewayRoutingConfig),
        resources=gateway.get("resources") or {})


def _read_gpu(spec: dict) -> GPUSpec:
    gpu = section_of(spec, "gpu")
    nccl_env = gpu.get("ncclEnv") or {}
    for name in nccl_env:
        if not name.startswith("NCCL_"):
            raise InvalidSpec(f"spec.gpu.ncclEnv: {name!r} is not an NCCL_* variable")
    return GPUSpec(per_pod=count_of(gpu, "gpu", "perPod", GPUSpec.per_pod),
                   resource_name=gpu.get("resourceName", GPUSpec.resource_name),
                   nccl_env={k: str(v) for k, v in nccl_env.items()})


def _read_ucx_env(spec: dict) -> dict[str, str]:
    ucx_env = spec.get("ucxEnv") or {}
    for name in ucx_env:
        if not name.startswith("UCX_"):
            raise InvalidSpec(f"spec.ucxEnv: {name!r} is not a UCX_* variable")
    return {k: str(v) for k, v in ucx_env.items()}


def _read_autoscaling(spec: dict) -> AutoscalingSpec:
    autoscaling = section_of(spec, "autoscaling")
    enabled = autoscaling.get("enabled", False)
    if not isinstance(enabled, bool):
        raise InvalidSpec(f"spec.autoscaling.enabled must be true or false, got {enabled!r}")
    interval_s = values_of(spec, PlannerConfig).get("interval_s")
    # The history a decision reads spans several scrapes whatever their interval.
    window_s = max(PlannerConfig.window_s, 4 * interval_s) if isinstance(
        interval_s, (int, float)) else None
    planner = settings_of(spec, "autoscaling", PlannerConfig, window_s=window_s)
    return AutoscalingSpec(enabled=enabled, planner=planner)


def _read_pods(spec: dict) -> tuple[dict[str, PodOverlay], dict[str, DisruptionBudget]]:
    """``spec.<role>.pod`` and ``spec.<role>.podDisruptionBudget`` of every role; the
    service-wide ``spec.nodeSelector`` and ``spec.tolerations`` reach every role's pods."""
    node_selector, tolerations = spec.get("nodeSelector") or {}, spec.get("tolerations") or []
    if not isinstance(node_selector, dict) or not isinstance(tolerations, list):
        raise InvalidSpec("spec.nodeSelector must be an object and spec.tolerations a list")
    pods, budgets = {}, {}
    for role in disruption_budgets.ROLES:
        section, where = section_of(spec, role), f"spec.{role}.podDisruptionBudget"
        try:
            pods[role] = pod_overlay.read(section.get("pod"), f"spec.{role}.pod",
                                          node_selector, tolerations)
            budgets[role] = disruption_budgets.read(section.get("podDisruptionBudget"), where)
        except (TypeError, ValueError) as e:
            raise InvalidSpec(str(e)) from e
    return pods, budgets


def _pull_secrets(spec: dict) -> list[str]:
    try:
        return pod_overlay.pull_secrets(spec.get("imagePullSecrets"), "spec.imagePullSecrets")
    except ValueError as e:
        raise InvalidSpec(str(e)) from e


def _check_lengths(model: ModelSource, prefill: PrefillSpec, decode: DecodeSpec) -> None:
    """The gateway accepts what a decode pod serves: a chain must take every prompt that
    fits (0 = the model's own limit, the longest there is)."""
    chains = prefill.max_model_len or model.config.max_model_len
    pods = decode.max_model_len or model.config.max_model_len
    if chains and (not pods or chains < pods):
        raise InvalidSpec(f"spec.prefill.maxModelLen {chains} is below the decode pods' "
                          f"{pods or 'full model length'}: a chain would refuse prompts the "
                          f"gateway accepts; raise it or lower spec.decode.maxModelLen")


def read_spec(spec: dict, default_image: str) -> ServiceSpec:
    """The typed spec of a `BatonService`; raises InvalidSpec naming the first bad value."""
    image = section_of(spec, "image")
    repository, tag = image.get("repository", ""), image.get("tag", "")
    model, prefill, decode = _read_model(spec), _read_prefill(spec), _read_decode(spec)
    _check_lengths(model, prefill, decode)
    pods, budgets = _read_pods(spec)
    return ServiceSpec(
        image=f"{repository}:{tag}" if repository and tag else repository or default_image,
        image_pull_policy=image.get("pullPolicy", "IfNotPresent"),
        model=model,
        prefill=prefill,
        decode=decode,
        pyramid=settings_of(spec, "compression", PyramidConfig),
        redis=_read_redis(spec),
        gateway=_read_gateway(spec),
        gpu=_read_gpu(spec),
        mtls=read_mtls(spec),
        autoscaling=_read_autoscaling(spec),
        pods=pods,
        disruption_budgets=budgets,
        image_pull_secrets=_pull_secrets(spec),
        kv_transport=settings_of(spec, "kvTransport", KVTransportConfig),
        kv_cache=settings_of(spec, "kvCache", KVCacheConfig),
        ucx_env=_read_ucx_env(spec),
        log=settings_of(spec, "logging", LogConfig),
        otlp=settings_of(spec, "tracing", OtlpConfig),
    )
