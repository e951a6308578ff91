"""Reconcile against kmock's Kubernetes emulator: children, scaling, spec changes, errors, deletion."""

from __future__ import annotations

import pytest
from baton_operator.reconcile import Reconciler
from emulated_cluster import create_service

NS = "serving"
MTLS = {"mtls": {"secretName": "demo-mtls"}}
SPEC = {"prefill": {"chains": 2, "ranksPerChain": 3}, "decode": {"replicas": 2, "tokenBudget": 128},
        **MTLS}


@pytest.fixture
def reconciler(cluster):
    return Reconciler(cluster.kube, "registry.local/baton:test")


def _reconcile(cluster, reconciler, name="demo"):
    return reconciler.reconcile(cluster.kube.get("BatonService", NS, name))


def _args(obj: dict) -> list[str]:
    return obj["spec"]["template"]["spec"]["containers"][0]["args"]


def _flag(args: list[str], flag: str) -> str:
    return args[args.index(flag) + 1]


def _names(cluster, kind: str, name="demo") -> list[str]:
    return sorted(o["metadata"]["name"] for o in cluster.kube.list(kind, NS, f"baton.dev/service={name}"))


def test_create_builds_every_child_with_owner_references(cluster, reconciler):
    service = create_service(cluster.kube, "demo", SPEC)
    status = reconciler.reconcile(service)

    assert _names(cluster, "StatefulSet") == ["demo-prefill-0", "demo-prefill-1"]
    assert _names(cluster, "Deployment") == ["demo-decode", "demo-gateway", "demo-redis"]
    assert _names(cluster, "Service") == ["demo-gateway", "demo-prefill-0", "demo-prefill-1",
                                          "demo-redis"]
    chain = cluster.kube.get("StatefulSet", NS, "demo-prefill-1")
    assert chain["spec"]["replicas"] == 3 and chain["spec"]["serviceName"] == "demo-prefill-1"
    args = _args(chain)
    assert args[0] == "prefill"
    assert _flag(args, "--chain-ranks") == "3"
    assert _flag(args, "--chain-master-addr") == "demo-prefill-1-0.demo-prefill-1.serving.svc"
    assert _flag(args, "--chain-backend") == "gloo"  # no GPUs asked for
    assert "--chain-rank" not in args  # the pod ordinal comes in through the downward API
    env = {e["name"]: e for e in chain["spec"]["template"]["spec"]["containers"][0]["env"]}
    assert env["BATON_CHAIN_RANK"]["valueFrom"]["fieldRef"]["fieldPath"] == \
        "metadata.labels['apps.kubernetes.io/pod-index']"
    headless = cluster.kube.get("Service", NS, "demo-prefill-1")
    assert headless["spec"]["clusterIP"] == "None"
    assert headless["spec"]["selector"]["baton.dev/chain"] == "demo-prefill-1"

    decode = cluster.kube.get("Deployment", NS, "demo-decode")
    assert decode["spec"]["replicas"] == 2
    assert _flag(_args(decode), "--scheduler-token-budget") == "128"
    assert _flag(_args(decode), "--routing-redis-url") == "redis://demo-redis.serving.svc:6379/0"

    uid = service["metadata"]["uid"]
    for kind in ("StatefulSet", "Deployment", "Service"):
        for obj in cluster.kube.list(kind, NS, "baton.dev/service=demo"):
            assert obj["metadata"]["ownerReferences"][0]["uid"] == uid
    pools = {r: cluster.kube.get("BatonPool", NS, f"demo-{r}") for r in ("prefill", "decode")}
    assert pools["prefill"]["spec"]["replicas"] == 2 and pools["decode"]["spec"]["replicas"] == 2
    assert pools["decode"]["status"]["selector"] == "baton.dev/service=demo,baton.dev/role=decode"
    assert status["decode"]["ready"] == "0/2"


def test_second_pass_writes_nothing(cluster, reconciler):
    create_service(cluster.kube, "demo", SPEC)
    _reconcile(cluster, reconciler)
    writes = cluster.writes()
    _reconcile(cluster, reconciler)
    assert cluster.writes() == writes


def test_scaling_pools_through_the_scale_subresource(cluster, reconciler):
    create_service(cluster.kube, "demo", SPEC)
    _reconcile(cluster, reconciler)

    # What `kubectl scale batonpool/demo-decode --replicas=5` sends.
    cluster.kube.patch("BatonPool", NS, "demo-decode", {"spec": {"replicas": 5}}, "scale")
    cluster.kube.patch("BatonPool", NS, "demo-prefill", {"spec": {"replicas": 3}}, "scale")
    _reconcile(cluster, reconciler)
    assert cluster.kube.get("Deployment", NS, "demo-decode")["spec"]["replicas"] == 5
    assert _names(cluster, "StatefulSet") == [f"demo-prefill-{i}" for i in range(3)]

    cluster.kube.patch("BatonPool", NS, "demo-prefill", {"spec": {"replicas": 1}}, "scale")
    status = _reconcile(cluster, reconciler)
    assert _names(cluster, "StatefulSet") == ["demo-prefill-0"]
    assert "demo-prefill-2" not in _names(cluster, "Service")
    assert status["prefill"]["replicas"] == 1 and status["decode"]["replicas"] == 5

    # Scaling does not get undone by a later pass that still sees the service's old numbers.
    _reconcile(cluster, reconciler)
    assert cluster.kube.get("Deployment", NS, "demo-decode")["spec"]["replicas"] == 5


def test_spec_change_updates_children(cluster, reconciler):
    create_service(cluster.kube, "demo", SPEC)
    _reconcile(cluster, reconciler)
    cluster.kube.patch("BatonService", NS, "demo", {"metadata": {"generation": 2}, "spec": {
        "decode": {"replicas": 4, "tokenBudget": 512, "streamIntervalMs": 20},
        "redis": {"mode": "external", "external": {"urlSecretRef": {"name": "redis-url"}}},
        "prefill": {"partitionTable": '{"entries": []}'}}})
    status = _reconcile(cluster, reconciler)

    decode = cluster.kube.get("Deployment", NS, "demo-decode")
    assert decode["spec"]["replicas"] == 4  # the service's own value changed: it wins
    assert _flag(_args(decode), "--scheduler-token-budget") == "512"
    assert float(_flag(_args(decode), "--stream-interval-ms")) == 20
    assert "--routing-redis-url" not in _args(decode)
    env = {e["name"]: e for e in decode["spec"]["template"]["spec"]["containers"][0]["env"]}
    assert env["BATON_ROUTING_REDIS_URL"]["valueFrom"]["secretKeyRef"] == {
        "name": "redis-url", "key": "url"}
    assert "demo-redis" not in _names(cluster, "Deployment")  # managed Redis pruned
    table = cluster.kube.get("ConfigMap", NS, "demo-partitions")
    assert table["data"]["partitions.json"] == '{"entries": []}'
    chain_args = _args(cluster.kube.get("StatefulSet", NS, "demo-prefill-0"))
    assert _flag(chain_args, "--chain-partition-table") == "/etc/baton/partitions/partitions.json"
    assert all(c["observedGeneration"] == 2 for c in status["conditions"])


def test_gpu_spec_asks_for_gpus_and_nccl(cluster, reconciler):
    create_service(cluster.kube, "demo", {**SPEC, "gpu": {
        "perPod": 2, "ncclEnv": {"NCCL_DEBUG": "INFO"}}})
    _reconcile(cluster, reconciler)
    chain = cluster.kube.get("StatefulSet", NS, "demo-prefill-0")
    container = chain["spec"]["template"]["spec"]["containers"][0]
    assert container["resources"]["limits"]["nvidia.com/gpu"] == 2
    assert _flag(container["args"], "--chain-backend") == "nccl"
    assert _flag(container["args"], "--model-device") == "cuda"
    assert {"name": "NCCL_DEBUG", "value": "INFO"} in container["env"]
    assert {"name": "dshm", "mountPath": "/dev/shm"} in container["volumeMounts"]


def test_a_tensor_parallel_decode_pod_asks_for_a_device_per_rank(cluster, reconciler):
    create_service(cluster.kube, "demo", {**SPEC, "gpu": {"perPod": 1},
                                          "decode": {"tensorParallelSize": 4}})
    _reconcile(cluster, reconciler)
    decode = cluster.kube.get("Deployment", NS, "demo-decode")
    container = decode["spec"]["template"]["spec"]["containers"][0]
    assert container["resources"]["limits"]["nvidia.com/gpu"] == 4
    assert _flag(container["args"], "--tensor-parallel-size") == "4"
    assert _flag(container["args"], "--tensor-parallel-backend") == "nccl"
    assert {"name": "dshm", "mountPath": "/dev/shm"} in container["volumeMounts"]
    chain = cluster.kube.get("StatefulSet", NS, "demo-prefill-0")  # a chain rank: one device
    assert chain["spec"]["template"]["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == 1


def test_a_tensor_parallel_chain_rank_asks_for_a_device_per_rank(cluster, reconciler):
    create_service(cluster.kube, "demo", {**SPEC, "gpu": {"perPod": 1},
                                          "prefill": {"tensorParallelSize": 2}})
    _reconcile(cluster, reconciler)
    chain = cluster.kube.get("StatefulSet", NS, "demo-prefill-0")
    container = chain["spec"]["template"]["spec"]["containers"][0]
    assert container["resources"]["limits"]["nvidia.com/gpu"] == 2
    assert _flag(container["args"], "--tensor-parallel-size") == "2"
    decode = cluster.kube.get("Deployment", NS, "demo-decode")
    assert "--tensor-parallel-size" not in decode["spec"]["template"]["spec"]["containers"][0]["args"]


@pytest.mark.parametrize("bad, says", [
    ({"compression": {"keepRatio": 1.5}}, "keep_ratio"),
    ({"redis": {"mode": "external"}}, "urlSecretRef"),
    ({"decode": {"tokenBudget": 64, "replicas": -1}}, "decode.replicas"),
    ({"decode": {"streamIntervalMs": -5}}, "stream interval_ms must be in 0..1000, got -5"),
    ({"prefill": {"ranksPerChain": 0}}, "chain ranks"),
    ({"prefill": {"kvLinkGBPerSecond": 0}}, "chain kv_link_gb_per_s must be > 0, got 0"),
    ({"routing": {"chainFailure": "retry"}}, "chain_failure"),
    ({"gateway": {"http": {"port": 9090}}}, "the gateway pod's metrics port"),
    ({"gateway": {"http": {"port": 70000}}}, "http port must be in 0..65535, got 70000"),
    ({"gateway": {"apiKeys": {"secretName": "keys", "key": "../keys"}}}, "apiKeys.key"),
    ({"kvTransport": "rdma"}, "spec.kvTransport: kv_transport kind 'rdma' is not one of"),
    ({"kvCache": {"dtype": "int4"}}, "kv_cache dtype 'int4' is not one of"),
    ({"kvCache": {"dtype": "fp8_e4m3", "scale": 0}}, "kv_cache scale"),
    ({"ucxEnv": {"LD_PRELOAD": "/x.so"}}, "spec.ucxEnv: 'LD_PRELOAD' is not a UCX_* variable"),
])
def test_invalid_spec_sets_degraded_and_builds_nothing(cluster, reconciler, bad, says):
    from baton_operator.spec import InvalidSpec

    service = create_service(cluster.kube, "demo", {**MTLS, **bad})
    with pytest.raises(InvalidSpec) as raised:
        reconciler.reconcile(service)
    reconciler.record_invalid(service, raised.value)

    status = cluster.kube.get("BatonService", NS, "demo")["status"]
    degraded = next(c for c in status["conditions"] if c["type"] == "Degraded")
    assert degraded["status"] == "True" and degraded["reason"] == "InvalidSpec"
    assert says in degraded["message"]
    assert _names(cluster, "Deployment") == []


def test_ready_condition_follows_children(cluster, reconciler):
    create_service(cluster.kube, "demo", {**SPEC, "prefill": {"chains": 1, "ranksPerChain": 2}})
    status = _reconcile(cluster, reconciler)
    ready = next(c for c in status["conditions"] if c["type"] == "Ready")
    assert ready["status"] == "False" and "decode 0/2" in ready["message"]

    # The emulator runs no controllers: play them.
    for kind, name, count in (("StatefulSet", "demo-prefill-0", 2), ("Deployment", "demo-decode", 2),
                              ("Deployment", "demo-gateway", 1)):
        cluster.kube.patch(kind, NS, name, {"status": {"readyReplicas": count}}, "status")
    status = _reconcile(cluster, reconciler)
    conditions = {c["type"]: c["status"] for c in status["conditions"]}
    assert conditions == {"Ready": "True", "Progressing": "False", "Degraded": "False",
                          "KVContractMismatch": "False"}
    assert cluster.kube.get("BatonPool", NS, "demo-decode")["status"]["readyReplicas"] == 2


def test_delete_removes_children_and_pools(cluster, reconciler):
    create_service(cluster.kube, "demo", SPEC)
    create_service(cluster.kube, "other", {"prefill": {"chains": 0}, **MTLS})
    _reconcile(cluster, reconciler)
    _reconcile(cluster, reconciler, "other")

    removed = reconciler.delete("demo", NS)
    assert removed > 0
    for kind in ("StatefulSet", "Deployment", "Service"):
        assert _names(cluster, kind) == []
    assert cluster.kube.get("BatonPool", NS, "demo-decode") is None
    assert _names(cluster, "Deployment", "other") == ["other-decode", "other-gateway",
                                                      "other-redis"]


def test_everything_written_validates_against_the_schemas(cluster, reconciler):
    from helm.chart_render import validate  # tests/ is on sys.path through its conftest

    create_service(cluster.kube, "demo", {
        **SPEC, "model": {"uri": "host:///data/models/llama", "revision": "r1"},
        "mtls": {"secretName": "demo-mtls", "secretNames": {"decode": "demo-mtls-decode"}},
        "prefill": {"chains": 1, "ranksPerChain": 2, "partitionTable": '{"entries": []}'},
        "redis": {"mode": "external", "external": {"urlSecretRef": {"name": "redis-url"}}},
        "gateway": {"tls": {"secretName": "gateway-tls"}, "serviceType": "LoadBalancer",
                    "http": {"enabled": True, "port": 8080},
                    "apiKeys": {"secretName": "gateway-keys", "key": "keys.txt"}},
        "gpu": {"perPod": 1, "ncclEnv": {"NCCL_DEBUG": "WARN"}},
        "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists"}]})
    _reconcile(cluster, reconciler)

    written = [cluster.kube.get("BatonService", NS, "demo")]
    written += [cluster.kube.get("BatonPool", NS, f"demo-{r}") for r in ("prefill", "decode")]
    for kind in ("ConfigMap", "Service", "Deployment", "StatefulSet"):
        written += cluster.kube.list(kind, NS, "baton.dev/service=demo")
    assert {o["kind"] for o in written} == {"BatonService", "BatonPool", "ConfigMap", "Service",
                                            "Deployment", "StatefulSet"}
    for obj in written:
        validate(obj)


def test_the_routing_settings_reach_the_gateway(cluster, reconciler):
    create_service(cluster.kube, "demo", {**SPEC, "routing": {
        "migrationLimit": 0, "chainFailure": "fail", "rerouteWaitSeconds": 5,
        "chainMaxQueuedTokens": 0, "prefillThresholdTokens": 2048, "chainBreakEven": False,
        "policy": "least-loaded"}, "decode": {**SPEC.get("decode", {}), "prefixCache": False,
                                              "cudaGraphs": False}})
    _reconcile(cluster, reconciler)
    args = _args(cluster.kube.get("Deployment", NS, "demo-gateway"))
    assert _flag(args, "--gateway-prefill-threshold-tokens") == "2048"
    assert _flag(args, "--gateway-chain-break-even") == "false"
    assert _flag(args, "--gateway-migration-limit") == "0"
    assert _flag(args, "--gateway-chain-failure") == "fail"
    assert float(_flag(args, "--gateway-reroute-wait-s")) == 5
    assert _flag(args, "--gateway-chain-max-queued-tokens") == "0"
    assert _flag(args, "--gateway-policy") == "least-loaded"
    decode_args = _args(cluster.kube.get("Deployment", NS, "demo-decode"))
    assert _flag(decode_args, "--kv-prefix-cache") == "false"
    assert _flag(decode_args, "--scheduler-cuda-graphs") == "false"


def test_the_kv_transport_reaches_the_chains_and_the_decode_pods(cluster, reconciler):
    create_service(cluster.kube, "demo", {**SPEC, "kvTransport": "nixl", "prefill": {
        **SPEC.get("prefill", {}), "kvLinkGBPerSecond": 11, "extraHopMs": 1},
        "ucxEnv": {"UCX_NET_DEVICES": "mlx5_0:1"}})
    _reconcile(cluster, reconciler)
    for kind, name in (("StatefulSet", "demo-prefill-0"), ("Deployment", "demo-decode")):
        assert _flag(_args(cluster.kube.get(kind, NS, name)), "--kv-transport-kind") == "nixl"
        container = cluster.kube.get(kind, NS, name)["spec"]["template"]["spec"]["containers"][0]
        assert {"name": "UCX_NET_DEVICES", "value": "mlx5_0:1"} in container["env"]
    gateway = cluster.kube.get("Deployment", NS, "demo-gateway")["spec"]["template"]["spec"]
    assert not any(e["name"].startswith("UCX_") for e in gateway["containers"][0]["env"])
    chain_args = _args(cluster.kube.get("StatefulSet", NS, "demo-prefill-0"))
    assert float(_flag(chain_args, "--chain-kv-link-gb-per-s")) == 11  # its break-even's inputs
    assert float(_flag(chain_args, "--chain-extra-hop-ms")) == 1
    assert "--kv-transport-kind" not in _args(cluster.kube.get("Deployment", NS, "demo-gateway"))


def test_an_fp8_kv_cache_reaches_the_chains_and_the_decode_pods_alike(cluster, reconciler):
    # the KV contract: a chain and the decode pods it ships to must store the same bytes
    create_service(cluster.kube, "demo", {**SPEC, "kvCache": {"dtype": "fp8_e4m3", "scale": 0.5}})
    _reconcile(cluster, reconciler)
    for kind, name in (("StatefulSet", "demo-prefill-0"), ("Deployment", "demo-decode")):
        args = _args(cluster.kube.get(kind, NS, name))
        assert _flag(args, "--kv-cache-dtype") == "fp8_e4m3" and float(_flag(args, "--kv-cache-scale")) == 0.5
    assert "--kv-cache-dtype" not in _args(cluster.kube.get("Deployment", NS, "demo-gateway"))


def test_logs_and_traces_reach_every_pod(cluster, reconciler):
    create_service(cluster.kube, "demo", {**SPEC, "logging": {"level": "DEBUG", "format": "json",
                                                              "requests": True},
                                          "tracing": {"otlpTracesEndpoint": "http://otel:4317"}})
    _reconcile(cluster, reconciler)
    for kind, name in (("StatefulSet", "demo-prefill-0"), ("Deployment", "demo-decode"),
                       ("Deployment", "demo-gateway")):
        args = _args(cluster.kube.get(kind, NS, name))
        assert _flag(args, "--log-level") == "DEBUG" and _flag(args, "--log-format") == "json"
        assert _flag(args, "--log-requests") == "true"
        assert _flag(args, "--otlp-traces-endpoint") == "http://otel:4317"


def _container(obj: dict) -> dict:
    return obj["spec"]["template"]["spec"]["containers"][0]


def test_the_http_api_and_api_keys_reach_the_gateway(cluster, reconciler):
    create_service(cluster.kube, "demo", {**SPEC, "gateway": {
        "http": {"port": 8080}, "apiKeys": {"secretName": "gateway-keys"}}})
    _reconcile(cluster, reconciler)
    deployment = cluster.kube.get("Deployment", NS, "demo-gateway")
    container = _container(deployment)
    assert {"name": "http", "containerPort": 8080} in container["ports"]
    assert _flag(container["args"], "--http-host") == "0.0.0.0"
    assert _flag(container["args"], "--http-port") == "8080"
    ports = cluster.kube.get("Service", NS, "demo-gateway")["spec"]["ports"]
    assert [(p["name"], p["port"], p["targetPort"]) for p in ports] == [
        ("grpc", 50051, "grpc"), ("http", 8080, "http")]
    # The keys file is inside the read-only Secret volume (whole, so the kubelet refreshes it).
    assert _flag(container["args"], "--auth-api-keys-file") == "/etc/baton/api-keys/keys"
    assert {"name": "api-keys", "mountPath": "/etc/baton/api-keys", "readOnly": True} in \
        container["volumeMounts"]
    assert {"name": "api-keys", "secret": {"secretName": "gateway-keys", "items": [
        {"key": "keys", "path": "keys"}]}} in deployment["spec"]["template"]["spec"]["volumes"]

    # Turning the HTTP API off and the keys away takes both out of the running objects.
    cluster.kube.patch("BatonService", NS, "demo", {"metadata": {"generation": 2}, "spec": {
        "gateway": {"http": {"enabled": False}, "apiKeys": None}}})
    _reconcile(cluster, reconciler)
    container = _container(cluster.kube.get("Deployment", NS, "demo-gateway"))
    assert [p["name"] for p in container["ports"]] == ["grpc", "metrics"]
    assert _flag(container["args"], "--http-port") == "0"
    assert "--auth-api-keys-file" not in container["args"]
    assert "api-keys" not in {m["name"] for m in container["volumeMounts"]}
    ports = cluster.kube.get("Service", NS, "demo-gateway")["spec"]["ports"]
    assert [p["name"] for p in ports] == ["grpc"]


ROLE_SECRETS = {"gateway": "mtls-gateway", "prefill": "mtls-prefill", "decode": "mtls-decode"}


def _pods(cluster) -> dict[str, dict]:
    """Role -> one pod template of that role the operator wrote (gateway, prefill, decode)."""
    pods = {}
    for kind in ("Deployment", "StatefulSet"):
        for obj in cluster.kube.list(kind, NS, "baton.dev/service=demo"):
            template = obj["spec"]["template"]
            role = template["metadata"]["labels"]["baton.dev/role"]
            if role != "redis":
                pods[role] = template["spec"]
    assert set(pods) == set(ROLE_SECRETS)
    return pods


def test_every_pod_mounts_its_roles_certificates_whole_and_read_only(cluster, reconciler):
    from baton_operator import workloads

    create_service(cluster.kube, "demo", {**SPEC, "mtls": {"secretName": "shared",
                                                           "secretNames": ROLE_SECRETS}})
    _reconcile(cluster, reconciler)
    for role, pod in _pods(cluster).items():
        container = pod["containers"][0]
        (volume,) = [v for v in pod["volumes"] if v["name"] == "mtls"]
        assert volume["secret"]["secretName"] == ROLE_SECRETS[role]  # the role's, over the shared
        assert [item["key"] for item in volume["secret"]["items"]] == ["ca.crt", "tls.crt", "tls.key"]
        (mount,) = [m for m in container["volumeMounts"] if m["name"] == "mtls"]
        # Whole volume (no subPath, which the kubelet never refreshes), read-only.
        assert mount == {"name": "mtls", "mountPath": workloads.MTLS_DIR, "readOnly": True}
        args = container["args"]
        for flag, file in (("--mtls-ca", "ca.crt"), ("--mtls-cert", "tls.crt"),
                           ("--mtls-key", "tls.key")):
            assert _flag(args, flag) == f"{workloads.MTLS_DIR}/{file}"
        assert "--mtls-insecure" not in args

    # Plaintext when asked: the flag, and no Secret volume left behind.
    cluster.kube.patch("BatonService", NS, "demo", {"metadata": {"generation": 2}, "spec": {
        "mtls": {"secretName": None, "secretNames": None, "insecure": True}}})
    _reconcile(cluster, reconciler)
    for pod in _pods(cluster).values():
        container = pod["containers"][0]
        assert _flag(container["args"], "--mtls-insecure") == "true"
        assert not [a for a in container["args"] if a in ("--mtls-ca", "--mtls-cert", "--mtls-key")]
        assert "mtls" not in {v["name"] for v in pod["volumes"]}
        assert "mtls" not in {m["name"] for m in container["volumeMounts"]}


@pytest.mark.parametrize("mtls, says", [
    (None, "names no Secret for gateway, prefill, decode pods"),
    ({"secretNames": {"gateway": "a", "decode": "b"}}, "names no Secret for prefill pods"),
    ({"insecure": True, "secretName": "shared"}, "not both"),
    ({"insecure": "yes"}, "spec.mtls.insecure must be true or false"),
    ({"secretNames": {"redis": "a"}}, "takes only gateway, prefill, decode"),
])
def test_no_pod_is_built_without_certificates_or_an_explicit_insecure(cluster, reconciler,
                                                                        mtls, says):
    from baton_operator.spec import InvalidSpec

    spec = {key: value for key, value in SPEC.items() if key != "mtls"}
    service = create_service(cluster.kube, "demo", {**spec, **({"mtls": mtls} if mtls else {})})
    with pytest.raises(InvalidSpec, match=says):
        reconciler.reconcile(service)
    assert _names(cluster, "Deployment") == [] and _names(cluster, "StatefulSet") == []


def test_probes_read_health_on_the_metrics_port_the_pod_ip_binds(cluster, reconciler):
    from baton_operator import workloads

    create_service(cluster.kube, "demo", SPEC)
    _reconcile(cluster, reconciler)
    for role, pod in _pods(cluster).items():
        container = pod["containers"][0]
        ports = {p["name"]: p["containerPort"] for p in container["ports"]}
        assert ports["metrics"] == workloads.METRICS_PORT
        # The gRPC ports want a client certificate the kubelet does not have.
        assert container["readinessProbe"]["httpGet"] == {"path": "/healthz", "port": "metrics"}, role
        # Liveness and startup ask only that the process answers: /healthz is 503 while a
        # server drains or a gateway has no live decode pod, no reason to restart it.
        for probe in ("livenessProbe", "startupProbe"):
            assert container[probe]["httpGet"] == {"path": "/livez", "port": "metrics"}, role
        for probe in ("readinessProbe", "livenessProbe", "startupProbe"):
            assert "grpc" not in container[probe]
        assert _flag(container["args"], "--server-metrics-port") == str(workloads.METRICS_PORT)
        assert _flag(container["args"], "--server-metrics-host") == "$(POD_IP)"
        env = {e["name"]: e for e in container["env"]}
        assert env["POD_IP"]["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"


def test_a_role_whose_environment_changes_the_kv_it_ships_is_a_contract_mismatch(cluster, reconciler):
    create_service(cluster.kube, "demo", SPEC)
    status = _reconcile(cluster, reconciler)
    agreed = next(c for c in status["conditions"] if c["type"] == "KVContractMismatch")
    assert (agreed["status"], agreed["reason"]) == ("False", "Consistent")

    # The decode pods alone told another dtype and keep ratio through their environment.
    cluster.kube.patch("BatonService", NS, "demo", {"spec": {"decode": {**SPEC["decode"], "pod": {
        "env": [{"name": "BATON_MODEL_DTYPE", "value": "float32"},
                {"name": "BATON_PYRAMID_KEEP_RATIO", "value": "0.25"}]}}}})
    status = _reconcile(cluster, reconciler)
    mismatch = next(c for c in status["conditions"] if c["type"] == "KVContractMismatch")
    assert (mismatch["status"], mismatch["reason"]) == ("True", "Mismatch")
    assert "kv dtype" not in mismatch["message"], "prefill's dtype auto is not said"
    assert "compression pyramid keep_ratio 0.5 != pyramid keep_ratio 0.25" in mismatch["message"]

    cluster.kube.patch("BatonService", NS, "demo", {"spec": {"prefill": {**SPEC["prefill"], "pod": {
        "env": [{"name": "BATON_MODEL_DTYPE", "value": "bfloat16"}]}}}})
    status = _reconcile(cluster, reconciler)
    mismatch = next(c for c in status["conditions"] if c["type"] == "KVContractMismatch")
    assert "kv dtype bfloat16 != float32" in mismatch["message"]
