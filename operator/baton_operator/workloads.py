"""The Kubernetes objects one `BatonService` becomes (pure functions of its spec).

    <name>-prefill-<i>   StatefulSet + headless Service per chain: p pods, rank = pod ordinal,
                         rank 0's stable DNS name is the torch.distributed rendezvous
    <name>-decode        Deployment of SARATHI decode workers
    <name>-gateway       Deployment + Service: the client endpoint (gRPC, and the OpenAI
                         HTTP API on Service port `http` unless turned off)
    <name>-redis         Deployment + Service, only when Redis is managed
    <name>-partitions    ConfigMap with the KV-Runahead partition table, when one is given
    <name>-<role>        PodDisruptionBudget per role (``disruption_budgets``)

Each role's pods take its scheduling, overlay and pull secrets (``pod_overlay``).

Prefill and decode pods mirror each other: one pod template builder, a role
label, and container arguments derived from the same configuration dataclasses
the services parse (``baton.config``), so a manifest cannot ask for a flag the
service does not know.

Every gateway, prefill and decode pod mounts its role's mTLS Secret whole at
``MTLS_DIR`` and gets ``--mtls-ca/--mtls-cert/--mtls-key``, or ``--mtls-insecure true``
when the service asks for plaintext; never neither (the services would refuse to
start). The kubelet cannot present a client certificate, so probes read ``/healthz``
on the metrics port, which binds the pod's IP.
"""

from __future__ import annotations

import hashlib
from typing import Any

from baton.config import ServerConfig
from baton.metrics import HEALTH_PATH, LIVE_PATH

from baton_operator import model_source, pod_overlay
from baton_operator.disruption_budgets import disruption_budgets
from baton_operator.layout import (
    API_KEYS_DIR,
    DECODE_PORT,
    GATEWAY_PORT,
    METRICS_PORT,
    MTLS_DIR,
    MTLS_FILES,
    PARTITIONS_DIR,
    PARTITIONS_FILE,
    POD_INDEX_LABEL,
    PREFILL_PORT,
    REDIS_PORT,
    RENDEZVOUS_PORT,
    RUN_AS_USER,
    SECRET_FILE_MODE,
    TERMINATION_MARGIN_S,
    TLS_DIR,
    chain_name,
    labels,
    selector,
)
from baton_operator.service_configs import (
    config_arguments,
    decode_config,
    gateway_config,
    prefill_config,
)
from baton_operator.spec import InvalidSpec, ServiceSpec


def _field_env(name: str, path: str) -> dict:
    return {"name": name, "valueFrom": {"fieldRef": {"fieldPath": path}}}


def _env(spec: ServiceSpec, role: str) -> list[dict]:
    env = [_field_env("POD_NAME", "metadata.name"), _field_env("POD_IP", "status.podIP"),
           {"name": "HOME", "value": "/tmp"},  # caches land in the writable emptyDir
           *model_source.server_env(spec.model)]
    if spec.redis.mode == "external":
        env.append({"name": "BATON_ROUTING_REDIS_URL", "valueFrom": {"secretKeyRef": {
            "name": spec.redis.secret_name, "key": spec.redis.secret_key}}})
    if role == "prefill":
        env.append(_field_env("BATON_CHAIN_RANK", f"metadata.labels['{POD_INDEX_LABEL}']"))
        if spec.gpu.per_pod:
            env += [{"name": k, "value": v} for k, v in sorted(spec.gpu.nccl_env.items())]
    if role in ("prefill", "decode"):  # the two ends of a push over NIXL
        env += [{"name": k, "value": v} for k, v in sorted(spec.ucx_env.items())]
    return env


def container_security() -> dict:
    """The restricted Pod Security profile, for every container baton runs."""
    return {"runAsNonRoot": True, "readOnlyRootFilesystem": True,
            "allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]},
            "seccompProfile": {"type": "RuntimeDefault"}}


def _volumes(name: str, spec: ServiceSpec, role: str) -> tuple[list[dict], list[dict]]:
    volumes = [{"name": "tmp", "emptyDir": {}}]
    mounts = [{"name": "tmp", "mountPath": "/tmp"}]
    model_volumes, model_mounts = model_source.model_volumes(spec.model)
    volumes += model_volumes
    mounts += model_mounts
    if role in ("prefill", "decode") and spec.gpu.per_pod:
        # NCCL's shared-memory transport needs more than the runtime's 64 MiB /dev/shm.
        volumes.append({"name": "dshm", "emptyDir": {"medium": "Memory"}})
        mounts.append({"name": "dshm", "mountPath": "/dev/shm"})
    if role == "prefill" and spec.prefill.partition_table:
        volumes.append({"name": "partitions", "configMap": {"name": f"{name}-partitions"}})
        mounts.append({"name": "partitions", "mountPath": PARTITIONS_DIR, "readOnly": True})
    if not spec.mtls.insecure:
        # Whole volume, no subPath: rotated certificates reach the running servers.
        volumes.append({"name": "mtls", "secret": {
            "secretName": spec.mtls.secret_names[role], "defaultMode": SECRET_FILE_MODE,
            "items": [{"key": file, "path": file} for file in MTLS_FILES.values()]}})
        mounts.append({"name": "mtls", "mountPath": MTLS_DIR, "readOnly": True})
    if role == "gateway" and spec.gateway.tls_secret_name:
        volumes.append({"name": "tls", "secret": {"secretName": spec.gateway.tls_secret_name}})
        mounts.append({"name": "tls", "mountPath": TLS_DIR, "readOnly": True})
    if (role == "gateway" or _http_port(spec, role)) and spec.gateway.api_keys_secret_name:
        # No subPath: the kubelet updates a whole-volume mount when the Secret changes, and
        # the gateway re-reads the file. A key missing from the Secret keeps the pod from starting.
        key = spec.gateway.api_keys_secret_key
        volumes.append({"name": "api-keys", "secret": {
            "secretName": spec.gateway.api_keys_secret_name, "items": [{"key": key, "path": key}]}})
        mounts.append({"name": "api-keys", "mountPath": API_KEYS_DIR, "readOnly": True})
    return volumes, mounts


def _http_port(spec: ServiceSpec, role: str) -> int:
    """The role's OpenAI HTTP port: the gateway's, or each decode pod's own door (an
    InferencePool endpoint); 0 = none."""
    return {"gateway": spec.gateway.http.port, "decode": spec.decode.http.port}.get(role, 0)


def _resources(spec: ServiceSpec, role: str, requested: dict) -> dict:
    resources = {k: dict(v) for k, v in requested.items()}
    if role in ("prefill", "decode") and spec.gpu.per_pod:
        resources.setdefault("limits", {})[spec.gpu.resource_name] = devices_per_pod(spec, role)
    return resources


def devices_per_pod(spec: ServiceSpec, role: str) -> int:
    """gpu.perPod for each of the pod's processes: one per tensor-parallel rank."""
    ranks = (spec.decode.tensor_parallel if role == "decode" else spec.prefill.tensor_parallel).size
    return spec.gpu.per_pod * ranks


def _probes() -> dict:
    """Readiness: /healthz says the server can take work (SERVING; a prefill rank other
    than 0 is ready while alive). Liveness: /livez, the process still answers (/healthz
    turns 503 when a gateway has no live decode pod or a server drains, which is no reason
    to restart it). Startup: /livez within 10 minutes, before liveness counts."""
    health = {"httpGet": {"path": HEALTH_PATH, "port": "metrics"}}
    live = {"httpGet": {"path": LIVE_PATH, "port": "metrics"}}
    return {"readinessProbe": {**health, "periodSeconds": 5},
            "livenessProbe": {**live, "periodSeconds": 10, "failureThreshold": 6},
            "startupProbe": {**live, "periodSeconds": 5, "failureThreshold": 120}}


def _init_containers(spec: ServiceSpec, role: str) -> dict:
    fetch = model_source.fetch_container(spec.model, role)
    if fetch is None:
        return {}
    return {"initContainers": [{**fetch, "image": spec.image,
                                "imagePullPolicy": spec.image_pull_policy,
                                "securityContext": container_security()}]}


def pod_template(name: str, spec: ServiceSpec, role: str, args: list[str], port: int,
                 resources: dict, extra_labels: dict | None = None) -> dict:
    """The pod every baton role runs in; roles differ only in arguments, ports and volumes."""
    volumes, mounts = _volumes(name, spec, role)
    ports = [{"name": "grpc", "containerPort": port}, {"name": "metrics",
                                                       "containerPort": METRICS_PORT}]
    if role == "prefill":
        ports.append({"name": "rendezvous", "containerPort": RENDEZVOUS_PORT})
    http_port = _http_port(spec, role)
    if http_port:
        ports.append({"name": "http", "containerPort": http_port})
    annotations = {}
    if role == "prefill" and spec.prefill.partition_table:
        # A new table must restart the chains that read it at startup.
        digest = hashlib.sha256(spec.prefill.partition_table.encode()).hexdigest()[:16]
        annotations["baton.dev/partition-table-sha256"] = digest
    pod_spec = {
        "securityContext": {"runAsNonRoot": True, "runAsUser": RUN_AS_USER,
                            "runAsGroup": RUN_AS_USER, "fsGroup": RUN_AS_USER,
                            "seccompProfile": {"type": "RuntimeDefault"}},
        "automountServiceAccountToken": False,
        # SIGTERM drains: in-flight streams get server.grace_s, then the process stops its
        # engine and exits; Kubernetes waits that long before SIGKILL, plus a margin.
        "terminationGracePeriodSeconds": int(ServerConfig().grace_s) + TERMINATION_MARGIN_S,
        **_init_containers(spec, role),
        "containers": [{
            "name": role, "image": spec.image, "imagePullPolicy": spec.image_pull_policy,
            "args": [role, *args], "env": _env(spec, role), "ports": ports,
            "volumeMounts": mounts, "resources": _resources(spec, role, resources),
            "securityContext": container_security(), **_probes(),
        }],
        "volumes": volumes,
    }
    metadata: dict[str, Any] = {"labels": {**labels(name, role), **(extra_labels or {})}}
    if annotations:
        metadata["annotations"] = annotations
    return _overlaid({"metadata": metadata, "spec": pod_spec}, spec, role)


def _overlaid(template: dict, spec: ServiceSpec, role: str) -> dict:
    """The role's scheduling, overlay and pull secrets added (``pod_overlay``)."""
    try:
        return pod_overlay.apply(template, spec.pods[role], spec.image_pull_secrets)
    except ValueError as e:
        raise InvalidSpec(f"spec.{role}.pod: {e}") from e


def _service(name: str, role: str, object_name: str, ports: list[dict], **spec: Any) -> dict:
    return {"apiVersion": "v1", "kind": "Service",
            "metadata": {"name": object_name, "labels": labels(name, role)},
            "spec": {"selector": selector(name, role), "ports": ports, **spec}}


def _port(port_name: str, port: int) -> dict:
    return {"name": port_name, "port": port, "targetPort": port_name, "protocol": "TCP"}


def prefill_chain(name: str, namespace: str, spec: ServiceSpec, index: int) -> list[dict]:
    chain = chain_name(name, index)
    args = config_arguments(prefill_config(name, namespace, spec, index))
    chain_labels = {"baton.dev/chain": chain}
    template = pod_template(name, spec, "prefill", args, PREFILL_PORT, spec.prefill.resources,
                            chain_labels)
    headless = _service(name, "prefill", chain,
                        [_port("grpc", PREFILL_PORT), _port("rendezvous", RENDEZVOUS_PORT)],
                        clusterIP="None", publishNotReadyAddresses=True)  # ranks meet before ready
    headless["spec"]["selector"] = {**selector(name, "prefill"), **chain_labels}
    statefulset = {
        "apiVersion": "apps/v1", "kind": "StatefulSet",
        "metadata": {"name": chain, "labels": {**labels(name, "prefill"), **chain_labels}},
        "spec": {"serviceName": chain, "replicas": spec.prefill.chain.ranks,
                 "podManagementPolicy": "Parallel",  # every rank must be up for the rendezvous
                 "selector": {"matchLabels": {**selector(name, "prefill"), **chain_labels}},
                 "template": template}}
    return [headless, statefulset]


def _deployment(name: str, role: str, replicas: int, template: dict) -> dict:
    return {"apiVersion": "apps/v1", "kind": "Deployment",
            "metadata": {"name": f"{name}-{role}", "labels": labels(name, role)},
            "spec": {"replicas": replicas, "selector": {"matchLabels": selector(name, role)},
                     "template": template}}


def decode_workers(name: str, namespace: str, spec: ServiceSpec, replicas: int) -> list[dict]:
    args = config_arguments(decode_config(name, namespace, spec))
    template = pod_template(name, spec, "decode", args, DECODE_PORT, spec.decode.resources)
    return [_deployment(name, "decode", replicas, template)]


def gateway(name: str, namespace: str, spec: ServiceSpec) -> list[dict]:
    args = config_arguments(gateway_config(name, namespace, spec))
    template = pod_template(name, spec, "gateway", args, GATEWAY_PORT, spec.gateway.resources)
    ports = [_port("grpc", GATEWAY_PORT)]
    if spec.gateway.http.port:
        ports.append(_port("http", spec.gateway.http.port))
    return [_deployment(name, "gateway", spec.gateway.replicas, template),
            _service(name, "gateway", f"{name}-gateway", ports, type=spec.gateway.service_type)]


def redis(name: str, spec: ServiceSpec) -> list[dict]:
    # Routing state is disposable (workers re-register by heartbeat): no persistence.
    container = {
        "name": "redis", "image": spec.redis.image,
        "args": ["--save", "", "--appendonly", "no", "--port", str(REDIS_PORT)],
        "ports": [{"name": "redis", "containerPort": REDIS_PORT}],
        "volumeMounts": [{"name": "data", "mountPath": "/data"}],
        "securityContext": container_security(),
        "readinessProbe": {"tcpSocket": {"port": REDIS_PORT}, "periodSeconds": 5},
        "resources": {"requests": {"cpu": "100m", "memory": "128Mi"},
                      "limits": {"memory": "512Mi"}}}
    template = {"metadata": {"labels": labels(name, "redis")}, "spec": {
        "securityContext": {"runAsNonRoot": True, "runAsUser": 999, "runAsGroup": 999,
                            "seccompProfile": {"type": "RuntimeDefault"}},
        "automountServiceAccountToken": False,
        "containers": [container], "volumes": [{"name": "data", "emptyDir": {}}]}}
    return [_deployment(name, "redis", 1, _overlaid(template, spec, "redis")),
            _service(name, "redis", f"{name}-redis", [_port("redis", REDIS_PORT)])]


def partition_table(name: str, spec: ServiceSpec) -> list[dict]:
    if not spec.prefill.partition_table:
        return []
    return [{"apiVersion": "v1", "kind": "ConfigMap",
             "metadata": {"name": f"{name}-partitions", "labels": labels(name, "prefill")},
             "data": {PARTITIONS_FILE: spec.prefill.partition_table}}]


def children(name: str, namespace: str, spec: ServiceSpec, num_chains: int,
             num_decode: int) -> list[dict]:
    """Every object the service needs, for the pools' current sizes."""
    objects = partition_table(name, spec) if num_chains else []
    if spec.redis.mode == "managed":
        objects += redis(name, spec)
    for index in range(num_chains):
        objects += prefill_chain(name, namespace, spec, index)
    objects += decode_workers(name, namespace, spec, num_decode)
    objects += gateway(name, namespace, spec)
    roles = ("gateway", "prefill", "decode", *(("redis",) if spec.redis.mode == "managed" else ()))
    objects += disruption_budgets(name, spec.disruption_budgets, roles)
    for obj in objects:
        obj["metadata"]["namespace"] = namespace
    return objects
