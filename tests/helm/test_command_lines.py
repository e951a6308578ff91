"""The container command lines the chart and the operator produce are ones the programs accept.

Each container's args and env are taken from the manifests, the kubelet's part is
played (downward-API values, `$(VAR)` expansion in args), and the result goes
through the `baton` CLI's own parser and configuration validation, so a renamed
flag or an out-of-range value in a manifest fails here, not in a crash-looping pod.
"""

from __future__ import annotations

import re

import pytest
from baton.config import HttpConfig
from baton.security.mtls import Mtls
from baton_operator import __main__ as operator_main
from baton_operator import workloads
from baton_operator.spec import read_spec
from chart_render import NAMESPACE, objects

# What the kubelet would resolve from the downward API and Secrets for one pod.
FIELD_VALUES = {"metadata.name": "baton-prefill-0-1", "status.podIP": "10.1.2.3",
                "metadata.namespace": NAMESPACE,
                f"metadata.labels['{workloads.POD_INDEX_LABEL}']": "1"}
SECRET_VALUE = "redis://:secret@redis.example:6379/0"


def container_env(container: dict) -> dict[str, str]:
    env = {}
    for var in container.get("env", []):
        if "value" in var:
            env[var["name"]] = var["value"]
        elif "fieldRef" in var["valueFrom"]:
            env[var["name"]] = FIELD_VALUES[var["valueFrom"]["fieldRef"]["fieldPath"]]
        else:
            env[var["name"]] = SECRET_VALUE
    return env


def expand(arg: str, env: dict[str, str]) -> str:
    """The kubelet's `$(VAR)` substitution in container args."""
    return re.sub(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", lambda m: env.get(m[1], m[0]), arg)


def load_with_baton_cli(container: dict, monkeypatch):
    """The validated configuration `baton <role> ...` would run with in this container."""
    import importlib

    from baton.cli import build_parser

    env = container_env(container)
    argv = [expand(arg, env) for arg in container["args"]]
    args = build_parser().parse_args(argv)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    config = importlib.import_module(f"baton.commands.{argv[0]}").load_config(args)
    # What `baton <role>` checks before it serves: certificates, or plaintext asked for.
    Mtls(config.mtls).check_service(argv[0])
    return config


def operator_children(values: dict, num_chains=2, num_decode=2) -> list[dict]:
    service = next(o for o in objects(values) if o["kind"] == "BatonService")
    return workloads.children(service["metadata"]["name"], NAMESPACE,
                              read_spec(service["spec"], "unused"), num_chains, num_decode)


def test_operator_containers_parse_as_baton_commands(chart_values, monkeypatch):
    configs = {}
    for obj in operator_children(chart_values):
        if obj["kind"] not in ("Deployment", "StatefulSet") or obj["metadata"]["name"].endswith(
                "-redis"):
            continue
        container = obj["spec"]["template"]["spec"]["containers"][0]
        configs[obj["metadata"]["name"]] = load_with_baton_cli(container, monkeypatch)

    assert set(configs) == {"baton-prefill-0", "baton-prefill-1", "baton-decode", "baton-gateway"}
    rank = configs["baton-prefill-1"]
    assert rank.chain.rank == 1  # from the pod-index label through BATON_CHAIN_RANK
    assert rank.chain.master_addr == "baton-prefill-1-0.baton-prefill-1.serving.svc"
    assert rank.server.advertise == "baton-prefill-0-1.baton-prefill-1.serving.svc:50071"
    assert rank.server.listen == f"0.0.0.0:{workloads.PREFILL_PORT}"
    assert configs["baton-decode"].server.advertise == f"10.1.2.3:{workloads.DECODE_PORT}"
    assert configs["baton-decode"].scheduler.token_budget == \
        chart_values.get("service", {}).get("spec", {}).get("decode", {}).get("tokenBudget", 0)
    gpu = bool(chart_values)
    assert rank.chain.backend == ("nccl" if gpu else "gloo")
    assert rank.model.device == ("cuda" if gpu else "cpu")
    for config in configs.values():
        assert config.routing.redis_url == "redis://baton-redis.serving.svc:6379/0"
        assert config.server.metrics_port == workloads.METRICS_PORT
        assert config.server.metrics_host == "10.1.2.3"  # the pod's IP: probes and scrapes reach it
        assert config.mtls.cert and not config.mtls.insecure  # secure by default
    assert configs["baton-gateway"].http.host == "0.0.0.0"  # reachable from other pods
    assert configs["baton-gateway"].http.port == HttpConfig().port
    assert configs["baton-gateway"].auth.api_keys_file == ""  # no Secret named: no keys


def _gateway(values: dict) -> tuple[dict, dict, dict]:
    """The operator's gateway Deployment, its container and its Service, for chart values."""
    children = {(o["kind"], o["metadata"]["name"]): o for o in operator_children(values)}
    deployment = children["Deployment", "baton-gateway"]
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    return deployment, container, children["Service", "baton-gateway"]


def test_the_gateway_serves_http_on_its_service_port_named_http(monkeypatch):
    values = {"service": {"spec": {"gateway": {"http": {"port": 8080}}}}}
    _, container, service = _gateway(values)
    config = load_with_baton_cli(container, monkeypatch)
    assert (config.http.host, config.http.port) == ("0.0.0.0", 8080)
    assert {"name": "http", "containerPort": 8080} in container["ports"]
    http = next(p for p in service["spec"]["ports"] if p["name"] == "http")
    assert (http["port"], http["targetPort"]) == (8080, "http")


def test_a_gateway_without_http_passes_port_0(monkeypatch):
    _, container, service = _gateway({"service": {"spec": {"gateway": {"http": {"enabled": False}}}}})
    assert "--http-port" in container["args"]
    assert load_with_baton_cli(container, monkeypatch).http.port == 0
    assert "http" not in {p["name"] for p in container["ports"]}
    assert [p["name"] for p in service["spec"]["ports"]] == ["grpc"]


def test_the_api_keys_file_lies_in_the_mounted_secret(monkeypatch):
    values = {"service": {"spec": {"gateway": {"apiKeys": {"secretName": "gateway-keys",
                                                             "key": "keys.txt"}}}}}
    deployment, container, _ = _gateway(values)
    keys_file = load_with_baton_cli(container, monkeypatch).auth.api_keys_file
    (volume,) = [v for v in deployment["spec"]["template"]["spec"]["volumes"]
                 if v.get("secret", {}).get("secretName") == "gateway-keys"]
    (mount,) = [m for m in container["volumeMounts"] if m["name"] == volume["name"]]
    assert mount["readOnly"] is True and "subPath" not in mount  # subPath mounts never refresh
    (item,) = volume["secret"]["items"]
    assert item["key"] == "keys.txt"
    assert keys_file == f"{mount['mountPath']}/{item['path']}"


def test_the_gateway_serves_grpc_tls_from_its_mounted_secret(monkeypatch):
    deployment, container, _ = _gateway({"service": {"spec": {"gateway": {
        "tls": {"secretName": "gateway-tls"}}}}})
    server = load_with_baton_cli(container, monkeypatch).server
    pod = deployment["spec"]["template"]["spec"]
    assert _secret_files(pod, container, server.tls_cert) == ("gateway-tls", "tls.crt")
    assert _secret_files(pod, container, server.tls_key) == ("gateway-tls", "tls.key")
    _, plain, _ = _gateway({})
    assert not load_with_baton_cli(plain, monkeypatch).server.tls_cert


def test_external_redis_url_reaches_every_role_from_the_secret(monkeypatch):
    values = {"service": {"spec": {"redis": {"mode": "external", "external": {
        "urlSecretRef": {"name": "routing-redis", "key": "url"}}}}}}
    for obj in operator_children(values):
        if obj["kind"] in ("Deployment", "StatefulSet"):
            container = obj["spec"]["template"]["spec"]["containers"][0]
            assert load_with_baton_cli(container, monkeypatch).routing.redis_url == SECRET_VALUE


def test_a_value_the_service_rejects_is_rejected_before_any_manifest():
    from baton_operator.spec import InvalidSpec

    service = next(o for o in objects() if o["kind"] == "BatonService")
    service["spec"]["decode"]["tokenBudget"] = 1
    with pytest.raises(InvalidSpec, match=r"token_budget must be 0 \(auto\) or >= 2"):
        read_spec(service["spec"], "unused")


def test_operator_deployment_args_parse_as_the_operator_cli(chart_values):
    for values in (chart_values, {"operator": {"allNamespaces": True}}):
        deployment = next(o for o in objects(values) if o["kind"] == "Deployment")
        container = deployment["spec"]["template"]["spec"]["containers"][0]
        assert container["command"] == ["python", "-m", "baton_operator"]
        args = operator_main.build_parser().parse_args(container["args"])
        operator_main.validate(args)
        assert args.image == container["image"]
        assert args.all_namespaces or args.namespace == [NAMESPACE]


def _pods_by_role(values: dict):
    """(role, pod spec, container) for every gateway, prefill and decode pod template."""
    for obj in operator_children(values):
        if obj["kind"] in ("Deployment", "StatefulSet"):
            pod = obj["spec"]["template"]["spec"]
            role = obj["spec"]["template"]["metadata"]["labels"]["baton.dev/role"]
            if role != "redis":
                yield role, pod, pod["containers"][0]


def _secret_files(pod: dict, container: dict, path: str) -> tuple[str, str]:
    """(Secret, key) that the kubelet puts at ``path`` in this container."""
    for mount in container["volumeMounts"]:
        if path.startswith(mount["mountPath"] + "/"):
            assert mount["readOnly"] is True and "subPath" not in mount  # whole, refreshed in place
            volume = next(v for v in pod["volumes"] if v["name"] == mount["name"])
            relative = path[len(mount["mountPath"]) + 1:]
            items = volume["secret"].get("items") or [{"key": relative, "path": relative}]
            item = next(i for i in items if i["path"] == relative)
            return volume["secret"]["secretName"], item["key"]
    raise AssertionError(f"{path} is in no mounted volume")


@pytest.mark.parametrize("mtls, secret_of_role", [
    ({}, "prod-baton-mtls-{role}"),  # the chart's generated certificates
    ({"certManager": {"enabled": True}}, "prod-baton-mtls-{role}"),
    ({"secretName": "our-pki"}, "our-pki"),
])
def test_every_pod_reads_its_certificates_from_the_mounted_secret(mtls, secret_of_role,
                                                                  monkeypatch):
    roles = set()
    for role, pod, container in _pods_by_role({"mtls": mtls}):
        config = load_with_baton_cli(container, monkeypatch)
        for path, key in ((config.mtls.ca, "ca.crt"), (config.mtls.cert, "tls.crt"),
                          (config.mtls.key, "tls.key")):
            assert _secret_files(pod, container, path) == (secret_of_role.format(role=role), key)
        roles.add(role)
    assert roles == {"gateway", "prefill", "decode"}


def test_plaintext_only_when_asked(monkeypatch):
    for role, pod, container in _pods_by_role({"mtls": {"insecure": True}}):
        config = load_with_baton_cli(container, monkeypatch)
        assert config.mtls.insecure and not config.mtls.cert, role
        assert not [v for v in pod["volumes"] if "secret" in v], role


def test_probes_reach_healthz_where_the_server_serves_it(monkeypatch):
    import socket
    import urllib.error
    import urllib.request

    from baton.metrics import serve_metrics
    from prometheus_client import CollectorRegistry

    for role, _, container in _pods_by_role({}):
        config = load_with_baton_cli(container, monkeypatch)
        ports = {p["name"]: p["containerPort"] for p in container["ports"]}
        for probe in ("readinessProbe", "livenessProbe", "startupProbe"):
            get = container[probe]["httpGet"]
            assert "host" not in get  # the kubelet calls the pod's IP, which metrics bind
            assert ports[get["port"]] == config.server.metrics_port, role
        readiness = container["readinessProbe"]["httpGet"]["path"]
        liveness = container["livenessProbe"]["httpGet"]["path"]
    # The paths answer as the probes need: readiness 200 only while serving, liveness always.
    serving = [False]
    with socket.socket() as probe_socket:  # a free port: serve_metrics takes 0 as "off"
        probe_socket.bind(("127.0.0.1", 0))
        port = probe_socket.getsockname()[1]
    stop = serve_metrics("127.0.0.1", port, CollectorRegistry(), lambda: serving[0])
    try:
        url = f"http://127.0.0.1:{port}"
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(url + readiness, timeout=5)
        assert refused.value.code == 503
        assert urllib.request.urlopen(url + liveness, timeout=5).status == 200
        serving[0] = True
        assert urllib.request.urlopen(url + readiness, timeout=5).status == 200
    finally:
        stop()
