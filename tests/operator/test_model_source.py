"""spec.model.uri against kmock's emulator: an hf:// model fetched by an init container into
the model cache, a pvc:// checkpoint mounted read-only, bad URIs refused naming the field,
and the served names and each role's sizing on every pod."""

from __future__ import annotations

import pytest
from baton_operator.reconcile import Reconciler
from baton_operator.spec import InvalidSpec
from emulated_cluster import create_service

NS = "serving"
BASE = {"prefill": {"chains": 1, "ranksPerChain": 2}, "decode": {"replicas": 1},
        "mtls": {"insecure": True}}
WORKLOADS = (("StatefulSet", "demo-prefill-0"), ("Deployment", "demo-decode"),
             ("Deployment", "demo-gateway"))


@pytest.fixture
def reconciler(cluster):
    return Reconciler(cluster.kube, "registry.local/baton:test")


def _pods(cluster, reconciler, model: dict, **spec) -> dict[str, dict]:
    """role -> pod spec of every baton workload the service becomes."""
    service = create_service(cluster.kube, "demo", {**BASE, **spec, "model": model})
    reconciler.reconcile(service)
    pods = {}
    for kind, name in WORKLOADS:
        pod = cluster.kube.get(kind, NS, name)["spec"]["template"]["spec"]
        pods[pod["containers"][0]["name"]] = pod
    return pods


def _flag(container: dict, flag: str) -> str | None:
    args = container["args"]
    return args[args.index(flag) + 1] if flag in args else None


def _env(container: dict) -> dict[str, dict]:
    return {e["name"]: e for e in container["env"]}


def _mounts(container: dict) -> dict[str, dict]:
    return {m["name"]: m for m in container["volumeMounts"]}


def test_an_hf_model_is_fetched_by_an_init_container_and_read_offline(cluster, reconciler):
    pods = _pods(cluster, reconciler, {
        "uri": "hf://meta-llama/Llama-3.1-8B-Instruct@0e9e39f",
        "tokenSecret": {"name": "hf-token", "key": "HF_TOKEN"},
        "cache": {"claimName": "model-cache"}})
    for role, pod in pods.items():
        (fetch,) = pod["initContainers"]
        assert fetch["image"] == "registry.local/baton:test"
        assert fetch["args"][:4] == ["fetch-model", "meta-llama/Llama-3.1-8B-Instruct",
                                     "--revision", "0e9e39f"]
        assert ("--without-weights" in fetch["args"]) == (role == "gateway")
        env = _env(fetch)
        assert env["HF_HOME"]["value"] == "/models/hf"
        assert env["HF_TOKEN"]["valueFrom"]["secretKeyRef"] == {"name": "hf-token",
                                                                "key": "HF_TOKEN"}
        assert "HF_HUB_OFFLINE" not in env
        assert _mounts(fetch)["model"] == {"name": "model", "mountPath": "/models/hf"}
        assert fetch["securityContext"]["readOnlyRootFilesystem"] is True
        volumes = {v["name"]: v for v in pod["volumes"]}
        assert volumes["model"]["persistentVolumeClaim"] == {"claimName": "model-cache"}

        server = pod["containers"][0]
        assert _flag(server, "--model-path") == "meta-llama/Llama-3.1-8B-Instruct"
        assert _flag(server, "--model-revision") == "0e9e39f"
        env = _env(server)
        assert env["HF_HOME"]["value"] == "/models/hf" and env["HF_HUB_OFFLINE"]["value"] == "1"
        assert "HF_TOKEN" not in env  # only the init container reads the token
        assert _mounts(server)["model"]["readOnly"] is True


def test_an_hf_model_without_a_cache_claim_goes_to_an_emptydir_per_pod(cluster, reconciler):
    pods = _pods(cluster, reconciler, {"uri": "hf://acme/tiny-coder", "offline": True,
                                       "cache": {"sizeLimit": "20Gi"}})
    decode = pods["decode"]
    assert {"name": "model", "emptyDir": {"sizeLimit": "20Gi"}} in decode["volumes"]
    (fetch,) = decode["initContainers"]
    assert fetch["args"] == ["fetch-model", "acme/tiny-coder"]  # main, unless told
    assert _env(fetch)["HF_HUB_OFFLINE"]["value"] == "1"
    assert "HF_TOKEN" not in _env(fetch)


def test_a_pvc_model_mounts_the_claim_read_only_and_reads_the_path(cluster, reconciler):
    pods = _pods(cluster, reconciler, {"uri": "pvc://models/llama-3.1-8b-instruct/",
                                       "revision": "2024-07"})
    for pod in pods.values():
        assert "initContainers" not in pod
        assert {"name": "model", "persistentVolumeClaim": {
            "claimName": "models", "readOnly": True}} in pod["volumes"]
        server = pod["containers"][0]
        assert _mounts(server)["model"] == {"name": "model", "mountPath": "/models/pvc",
                                            "readOnly": True}
        assert _flag(server, "--model-path") == "/models/pvc/llama-3.1-8b-instruct"
        assert _flag(server, "--model-revision") == "2024-07"
        assert "HF_HUB_OFFLINE" not in _env(server)


def test_the_shipped_model_needs_no_volume(cluster, reconciler):
    for pod in _pods(cluster, reconciler, {}).values():
        assert "initContainers" not in pod
        assert "model" not in {v["name"] for v in pod["volumes"]}
        assert _flag(pod["containers"][0], "--model-path") is None


def test_served_names_and_each_roles_sizing_reach_the_pods(cluster, reconciler):
    pods = _pods(cluster, reconciler, {"uri": "hf://acme/tiny-coder",
                                       "servedModelName": ["coder", "acme/tiny-coder"],
                                       "maxModelLen": 8192},
                 prefill={"chains": 1, "ranksPerChain": 2, "maxModelLen": 32768},
                 decode={"replicas": 1, "maxModelLen": 16384, "kvMemoryFraction": 0.9})
    for pod in pods.values():
        assert _flag(pod["containers"][0], "--model-served-model-name") == "coder,acme/tiny-coder"
    prefill, decode, gateway = (pods[r]["containers"][0] for r in ("prefill", "decode", "gateway"))
    assert _flag(prefill, "--model-max-model-len") == "32768"
    assert _flag(decode, "--model-max-model-len") == "16384"
    assert _flag(gateway, "--model-max-model-len") == "16384"  # what a decode pod serves
    assert float(_flag(decode, "--kv-memory-fraction")) == 0.9


def test_a_roles_limit_falls_back_to_the_models(cluster, reconciler):
    pods = _pods(cluster, reconciler, {"maxModelLen": 4096})
    for pod in pods.values():
        assert _flag(pod["containers"][0], "--model-max-model-len") == "4096"


@pytest.mark.parametrize("model, spec, says", [
    ({"uri": "s3://bucket/llama"}, {}, ("spec.model.uri 's3://bucket/llama': is not a model "
                                        "URI: give hf://org/name[@revision], pvc://claim[/path]")),
    ({"uri": "hf://llama"}, {}, "spec.model.uri 'hf://llama'"),
    ({"uri": "pvc://Models/llama"}, {}, "'Models' is not a PersistentVolumeClaim name"),
    ({"uri": "pvc://models/../etc"}, {}, "must not contain '..'"),
    ({"uri": "host:///"}, {}, "not the node's root"),
    ({"uri": "hf://acme/coder@v2", "revision": "v1"}, {}, "revision 'v2' but spec.model.revision"),
    ({"uri": "pvc://models/llama", "tokenSecret": {"name": "t"}}, {}, "hf:// spec.model.uri only"),
    ({"uri": "hf://acme/coder", "tokenSecret": {"key": "t"}}, {}, "tokenSecret.name is required"),
    ({"source": {"pvc": {"claimName": "models"}}}, {}, "spec.model.source is no longer read"),
    ({}, {"prefill": {"maxModelLen": 2048}, "decode": {"maxModelLen": 4096}},
     "spec.prefill.maxModelLen 2048 is below the decode pods' 4096"),
    ({}, {"decode": {"maxModelLen": -1}}, "spec.decode"),
])
def test_a_bad_model_is_refused_naming_the_field(cluster, reconciler, model, spec, says):
    service = create_service(cluster.kube, "demo", {**BASE, **spec, "model": model})
    with pytest.raises(InvalidSpec) as raised:
        reconciler.reconcile(service)
    reconciler.record_invalid(service, raised.value)
    status = cluster.kube.get("BatonService", NS, "demo")["status"]
    degraded = next(c for c in status["conditions"] if c["type"] == "Degraded")
    assert degraded["status"] == "True" and says in degraded["message"]
    assert cluster.kube.get("Deployment", NS, "demo-decode") is None


def test_what_an_hf_model_renders_validates_against_the_schemas(cluster, reconciler):
    from helm.chart_render import validate  # tests/ is on sys.path through its conftest

    _pods(cluster, reconciler, {"uri": "hf://acme/tiny-coder@main",
                                "tokenSecret": {"name": "hf-token"},
                                "cache": {"sizeLimit": "20Gi"}},
          decode={"replicas": 1, "maxModelLen": 2048})
    validate(cluster.kube.get("BatonService", NS, "demo"))
    for kind, name in WORKLOADS:
        validate(cluster.kube.get(kind, NS, name))
