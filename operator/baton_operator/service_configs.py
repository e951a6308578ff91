"""What each role's server is told: its ``baton.config`` service configuration, built from a
BatonService's spec, and the ``--flag value`` arguments that carry it (only the settings
that differ from the service's own defaults, so a manifest cannot ask for a flag the service
does not know)."""

from __future__ import annotations

import dataclasses
from typing import Any

from baton.config import (
    AuthConfig,
    DecodeHttpConfig,
    DecodeServiceConfig,
    GatewayServiceConfig,
    ModelSourceConfig,
    MtlsConfig,
    PrefillServiceConfig,
    RoutingConfig,
    ServerConfig,
)
from baton.configtree import flag_names

from baton_operator import model_source
from baton_operator.layout import (
    API_KEYS_DIR,
    DECODE_PORT,
    GATEWAY_PORT,
    METRICS_PORT,
    MTLS_DIR,
    MTLS_FILES,
    PARTITIONS_DIR,
    PARTITIONS_FILE,
    PREFILL_PORT,
    REDIS_PORT,
    RENDEZVOUS_PORT,
    TLS_DIR,
    chain_name,
)
from baton_operator.spec import InvalidSpec, ServiceSpec


def _leaves(config: Any):
    """Leaf values of a configuration tree, in the order `flag_names` walks it."""
    for f in dataclasses.fields(config):
        value = getattr(config, f.name)
        if dataclasses.is_dataclass(value):
            yield from _leaves(value)
        else:
            yield value


def config_arguments(config: Any) -> list[str]:
    """``--flag value`` for every setting that differs from the service's own default."""
    defaults = _leaves(type(config)())
    args = []
    for flag, value, default in zip(flag_names(type(config)), _leaves(config), defaults):
        if value == default:
            continue
        if isinstance(value, bool):
            value = "true" if value else "false"
        elif isinstance(value, list):
            value = ",".join(map(str, value))
        args += [flag, str(value)]
    return args


def _model_config(spec: ServiceSpec, role: str) -> ModelSourceConfig:
    """The model as ``role``'s pods see it (``baton_operator.model_source``), with the
    role's own length limit; a gateway takes the decode pods' (they serve whole requests)."""
    device = "cuda" if spec.gpu.per_pod and role != "gateway" else "cpu"  # a gateway tokenizes
    path, revision = model_source.served_path(spec.model)
    max_model_len = (spec.prefill.max_model_len if role == "prefill"
                     else spec.decode.max_model_len) or spec.model.config.max_model_len
    return dataclasses.replace(spec.model.config, path=path, revision=revision, device=device,
                               max_model_len=max_model_len)


def _server(port: int, advertise_host: str) -> ServerConfig:
    # $(VAR) is expanded by the kubelet from the container's env (see _env). Metrics and
    # /healthz bind the pod's IP, where Prometheus and the kubelet's probes reach them.
    return ServerConfig(listen=f"0.0.0.0:{port}", advertise=f"{advertise_host}:{port}",
                        metrics_port=METRICS_PORT, metrics_host="$(POD_IP)")


def _mtls(spec: ServiceSpec) -> MtlsConfig:
    """The role's certificate files in its mounted Secret, or plaintext when asked."""
    if spec.mtls.insecure:
        return MtlsConfig(insecure=True)
    return MtlsConfig(**{field: f"{MTLS_DIR}/{file}" for field, file in MTLS_FILES.items()})


def _routing(name: str, namespace: str, spec: ServiceSpec) -> RoutingConfig:
    if spec.redis.mode == "managed":
        return RoutingConfig(redis_url=f"redis://{name}-redis.{namespace}.svc:{REDIS_PORT}/0")
    return RoutingConfig()  # external: BATON_ROUTING_REDIS_URL comes from the Secret


def prefill_config(name: str, namespace: str, spec: ServiceSpec, index: int) -> PrefillServiceConfig:
    chain = chain_name(name, index)
    table = f"{PARTITIONS_DIR}/{PARTITIONS_FILE}" if spec.prefill.partition_table else ""
    return PrefillServiceConfig(
        server=_server(PREFILL_PORT, f"$(POD_NAME).{chain}.{namespace}.svc"),
        model=_model_config(spec, "prefill"),
        tensor_parallel=dataclasses.replace(spec.prefill.tensor_parallel,
                                            backend="nccl" if spec.gpu.per_pod else "gloo"),
        chain=dataclasses.replace(
            spec.prefill.chain, chain_id=chain, master_addr=f"{chain}-0.{chain}.{namespace}.svc",
            master_port=RENDEZVOUS_PORT, backend="nccl" if spec.gpu.per_pod else "gloo",
            partition_table=table),
        kv_transport=spec.kv_transport, kv_cache=spec.kv_cache, pyramid=spec.pyramid,
        routing=_routing(name, namespace, spec), mtls=_mtls(spec), log=spec.log, otlp=spec.otlp)


def decode_config(name: str, namespace: str, spec: ServiceSpec) -> DecodeServiceConfig:
    """A decode pod's; with its own OpenAI door on, the door routes as the gateway does (the
    same routing settings) and takes the gateway's API keys."""
    http = DecodeHttpConfig()
    if spec.decode.http.port:
        _check_http_port(spec.decode.http.port, "decode", DECODE_PORT)
        http = DecodeHttpConfig(**{**dataclasses.asdict(spec.decode.http), "host": "0.0.0.0"})
    return DecodeServiceConfig(
        server=_server(DECODE_PORT, "$(POD_IP)"), model=_model_config(spec, "decode"), kv=spec.decode.kv,
        tensor_parallel=dataclasses.replace(spec.decode.tensor_parallel,
                                            backend="nccl" if spec.gpu.per_pod else "gloo"),
        kv_transport=spec.kv_transport, kv_cache=spec.kv_cache, scheduler=spec.decode.scheduler,
        stream=spec.decode.stream, pyramid=spec.pyramid,
        routing=_routing(name, namespace, spec), mtls=_mtls(spec), http=http, log=spec.log, otlp=spec.otlp,
        gateway=spec.gateway.routing,
        auth=AuthConfig(api_keys_file=_api_keys_file(spec) if spec.decode.http.port else ""))


def _check_http_port(port: int, role: str, grpc_port: int) -> None:
    if port in (grpc_port, METRICS_PORT):
        raise InvalidSpec(f"spec.{role}.http.port {port} is the {role} pod's "
                          f"{'gRPC' if port == grpc_port else 'metrics'} port: pick another")


def _api_keys_file(spec: ServiceSpec) -> str:
    if not spec.gateway.api_keys_secret_name:
        return ""
    return f"{API_KEYS_DIR}/{spec.gateway.api_keys_secret_key}"


def gateway_config(name: str, namespace: str, spec: ServiceSpec) -> GatewayServiceConfig:
    _check_http_port(spec.gateway.http.port, "gateway", GATEWAY_PORT)
    server = _server(GATEWAY_PORT, "$(POD_IP)")
    if spec.gateway.tls_secret_name:  # clients' TLS on the public gRPC port (no client certificate)
        server = dataclasses.replace(server, tls_cert=f"{TLS_DIR}/tls.crt", tls_key=f"{TLS_DIR}/tls.key")
    return GatewayServiceConfig(
        server=server, model=_model_config(spec, "gateway"),
        gateway=spec.gateway.routing, routing=_routing(name, namespace, spec),
        http=dataclasses.replace(spec.gateway.http, host="0.0.0.0"),
        auth=AuthConfig(api_keys_file=_api_keys_file(spec)), mtls=_mtls(spec), log=spec.log,
        otlp=spec.otlp)
