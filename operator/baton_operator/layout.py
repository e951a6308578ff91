"""Where things are in a BatonService's pods: their ports, the directories its Secrets and
ConfigMaps are mounted at, the names of its chains and the labels of its objects. One
place, read by the pods' configuration (``service_configs``) and the objects that hold
them (``workloads``, ``disruption_budgets``)."""

from __future__ import annotations

GATEWAY_PORT = 50051
DECODE_PORT = 50061
PREFILL_PORT = 50071
METRICS_PORT = 9090
RENDEZVOUS_PORT = 29500
REDIS_PORT = 6379
RUN_AS_USER = 10001  # the image's non-root user
TERMINATION_MARGIN_S = 15  # past server.grace_s: stopping the engine, leaving routing
PARTITIONS_DIR = "/etc/baton/partitions"
PARTITIONS_FILE = "partitions.json"
TLS_DIR = "/etc/baton/tls"
API_KEYS_DIR = "/etc/baton/api-keys"  # the whole Secret volume: the kubelet refreshes it in place
MTLS_DIR = "/etc/baton/mtls"  # the role's whole Secret volume, refreshed in place on rotation
MTLS_FILES = {"ca": "ca.crt", "cert": "tls.crt", "key": "tls.key"}  # the kubernetes.io/tls layout
SECRET_FILE_MODE = 0o440  # owner root, group fsGroup (the baton user): nobody else reads keys
POD_INDEX_LABEL = "apps.kubernetes.io/pod-index"  # set by the StatefulSet controller (k8s >= 1.28)


def chain_name(name: str, index: int) -> str:
    return f"{name}-prefill-{index}"


def labels(name: str, role: str) -> dict[str, str]:
    return {
        "app.kubernetes.io/name": "baton",
        "app.kubernetes.io/instance": name,
        "app.kubernetes.io/component": role,
        "app.kubernetes.io/managed-by": "baton-operator",
        "baton.dev/service": name,
        "baton.dev/role": role,
    }


def selector(name: str, role: str) -> dict[str, str]:
    return {"baton.dev/service": name, "baton.dev/role": role}
