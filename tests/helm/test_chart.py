"""The chart lints clean, renders, validates, and runs everything under restricted pod security."""

from __future__ import annotations

import helm_python
import pytest
from baton_operator import workloads
from baton_operator.spec import read_spec
from chart_render import CHART, KUBE_VERSION, NAMESPACE, objects, render, validate


def test_chart_lints_without_findings(chart_values):
    report = helm_python.lint(CHART, chart_values, strict=True, namespace=NAMESPACE,
                              kube_version=f"v{KUBE_VERSION}")
    assert report["errors"] == []
    # Severity 1 is informational (a chart icon is recommended); nothing worse is allowed.
    assert [m for m in report["messages"] if m["severity"] > 1] == []


def test_every_rendered_object_validates(chart_values):
    rendered = objects(chart_values)
    kinds = sorted({o["kind"] for o in rendered})
    assert {"CustomResourceDefinition", "Deployment", "BatonService", "Role",
            "ServiceAccount"} <= set(kinds)
    for obj in rendered:
        validate(obj)


def test_every_object_the_operator_makes_validates(chart_values):
    service = next(o for o in objects(chart_values) if o["kind"] == "BatonService")
    spec = read_spec(service["spec"], "unused")
    children = workloads.children(service["metadata"]["name"], NAMESPACE, spec, 2, 3)
    assert {o["kind"] for o in children} == {"StatefulSet", "Service", "Deployment",
                                             "PodDisruptionBudget"}
    for obj in children:
        validate(obj)


def test_a_typo_in_the_service_spec_is_caught():
    from jsonschema import ValidationError

    service = next(o for o in objects() if o["kind"] == "BatonService")
    service["spec"]["decode"]["tokenBugdet"] = 512
    with pytest.raises(ValidationError, match="tokenBugdet"):
        validate(service)


def _pod_specs(rendered: list[dict]):
    for obj in rendered:
        if obj["kind"] in ("Deployment", "StatefulSet"):
            yield obj["metadata"]["name"], obj["spec"]["template"]["spec"]


def test_restricted_pod_security_everywhere(chart_values):
    rendered = objects(chart_values)
    service = next(o for o in rendered if o["kind"] == "BatonService")
    spec = read_spec(service["spec"], "unused")
    rendered += workloads.children("baton", NAMESPACE, spec, 1, 1)  # what the operator adds
    pods = dict(_pod_specs(rendered))
    assert {"prod-baton-operator", "baton-decode", "baton-gateway", "baton-prefill-0",
            "baton-redis"} <= set(pods)
    for name, pod in pods.items():
        assert pod["securityContext"]["runAsNonRoot"] is True, name
        assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}, name
        assert not pod.get("hostNetwork") and not pod.get("hostPID"), name
        writable = {v["name"] for v in pod["volumes"] if "emptyDir" in v}
        for container in pod["containers"]:
            security = container["securityContext"]
            assert security["runAsNonRoot"] is True, name
            assert security["readOnlyRootFilesystem"] is True, name
            assert security["allowPrivilegeEscalation"] is False, name
            assert security["capabilities"] == {"drop": ["ALL"]}, name
            assert security["seccompProfile"] == {"type": "RuntimeDefault"}, name
            assert not security.get("privileged"), name
            # With a read-only root, every cache lands in an emptyDir mounted at /tmp (or /data).
            mounted = {m["name"] for m in container["volumeMounts"] if m["name"] in writable}
            assert mounted, f"{name} has no writable emptyDir"


def test_rbac_is_least_privilege():
    for values in ({}, {"operator": {"allNamespaces": True}}):
        rules = [rule for obj in objects(values) if obj["kind"] in ("Role", "ClusterRole")
                 for rule in obj["rules"]]
        assert rules
        for rule in rules:
            for key in ("apiGroups", "resources", "verbs"):
                assert "*" not in rule[key], rule
            assert "secrets" not in rule["resources"], "the operator must not read Secrets"
            assert not {"escalate", "bind", "impersonate"} & set(rule["verbs"])
    # The leader Lease: created once, then read and renewed by patches (baton_operator.leader).
    leader = next(o for o in objects() if o["metadata"]["name"].endswith("-leader")
                  and o["kind"] == "Role")
    assert {(v, tuple(r.get("resourceNames", []))) for r in leader["rules"] for v in r["verbs"]} \
        == {("create", ()), ("get", ("prod-baton-operator",)), ("patch", ("prod-baton-operator",))}
    watched = objects({"operator": {"watchNamespaces": ["team-a", "team-b"]}})
    role_namespaces = {o["metadata"]["namespace"] for o in watched
                       if o["kind"] == "Role" and not o["metadata"]["name"].endswith("-leader")}
    assert role_namespaces == {"team-a", "team-b"}
    assert not [o for o in watched if o["kind"].startswith("Cluster")]


def test_gpu_values_schedule_on_gpus_only_the_roles_that_use_them():
    from chart_render import GPU_VALUES, values_file

    rendered = objects(values_file(GPU_VALUES))
    service = next(o for o in rendered if o["kind"] == "BatonService")
    spec = read_spec(service["spec"], "unused")
    pods = dict(_pod_specs([*rendered, *workloads.children("baton", NAMESPACE, spec, 1, 1)]))
    for name in ("baton-prefill-0", "baton-decode"):
        pod = pods[name]
        assert pod["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == 1
        assert pod["tolerations"][0]["key"] == "nvidia.com/gpu"
        assert pod["nodeSelector"] == {"nvidia.com/gpu.present": "true"}
    for name in ("baton-gateway", "baton-redis", "prod-baton-operator"):
        assert "nodeSelector" not in pods[name] and "tolerations" not in pods[name], name


def test_ucx_settings_go_from_the_values_to_both_ends_of_a_push():
    values = {"service": {"spec": {"kvTransport": "nixl",
                                   "ucxEnv": {"UCX_NET_DEVICES": "mlx5_0:1"}}}}
    service = next(o for o in objects(values) if o["kind"] == "BatonService")
    validate(service)
    spec = read_spec(service["spec"], "unused")
    pods = dict(_pod_specs(workloads.children("baton", NAMESPACE, spec, 1, 1)))
    for name in ("baton-prefill-0", "baton-decode"):
        assert {"name": "UCX_NET_DEVICES", "value": "mlx5_0:1"} in pods[name]["containers"][0]["env"]
    with helm_python.Chart.load(CHART) as chart, pytest.raises(helm_python.errors.HelmError):
        chart.validate_schema({"service": {"spec": {"ucxEnv": {"UCX_TLS": 3}}}})


def test_values_schema_rejects_bad_values():
    with helm_python.Chart.load(CHART) as chart:
        chart.validate_schema({})
        for bad in ({"operator": {"replicas": 0}}, {"image": {"pullPolicy": "Sometimes"}},
                    {"service": {"spec": {"decode": {"replicas": -1}}}}, {"typo": 1},
                    {"service": {"spec": {"gateway": {"http": {"port": 0}}}}},
                    {"service": {"spec": {"gateway": {"http": {"prot": 8080}}}}},
                    {"service": {"spec": {"gateway": {"apiKeys": {"key": "a/b"}}}}}):
            with pytest.raises(helm_python.errors.HelmError):
                chart.validate_schema(bad)


def test_notes_tell_how_to_call_and_scale():
    notes = render()["baton/templates/NOTES.txt"]
    assert "port-forward svc/baton-gateway 50051:50051" in notes
    assert "port-forward svc/baton-gateway 8000:8000" in notes
    assert "Authorization" not in notes
    keyed = render({"service": {"spec": {"gateway": {"apiKeys": {"secretName": "keys"}}}}})
    assert 'Authorization: Bearer $KEY' in keyed["baton/templates/NOTES.txt"]
    grpc_only = render({"service": {"spec": {"gateway": {"http": {"enabled": False}}}}})
    assert "8000" not in grpc_only["baton/templates/NOTES.txt"]
    assert "kubectl -n serving scale batonpool/baton-decode --replicas=4" in notes
