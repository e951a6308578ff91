"""Every option of a role's pods renders and validates: the operator's pod from
operator.pod, the others from service.spec.<role>.pod through the operator; pull secrets
reach every pod; each role has its PodDisruptionBudget."""

from __future__ import annotations

import helm_python
import pytest
from baton_operator import workloads
from baton_operator.spec import read_spec
from chart_render import CHART, NAMESPACE, objects, validate

POD = {"nodeSelector": {"pool": "system"},
       "tolerations": [{"key": "dedicated", "operator": "Equal", "value": "system",
                        "effect": "NoSchedule"}],
       "affinity": {"podAntiAffinity": {"preferredDuringSchedulingIgnoredDuringExecution": [
           {"weight": 100, "podAffinityTerm": {"topologyKey": "kubernetes.io/hostname",
                                               "labelSelector": {"matchLabels": {"a": "b"}}}}]}},
       "topologySpreadConstraints": [{"maxSkew": 1, "topologyKey": "topology.kubernetes.io/zone",
                                      "whenUnsatisfiable": "ScheduleAnyway"}],
       "priorityClassName": "system-high",
       "annotations": {"team.example/owner": "platform"}, "labels": {"team.example/tier": "gold"},
       "env": [{"name": "EXTRA", "value": "1"}], "volumes": [{"name": "extra", "emptyDir": {}}],
       "volumeMounts": [{"name": "extra", "mountPath": "/extra"}],
       "extraContainers": [{"name": "sidecar", "image": "busybox:1.36", "args": ["sleep", "inf"]}]}
EVERY_OPTION = {
    "imagePullSecrets": [{"name": "registry"}],
    "operator": {"pod": POD, "podDisruptionBudget": {"maxUnavailable": 0}},
    "service": {"spec": {role: {"pod": POD, "podDisruptionBudget": {"maxUnavailable": 2}}
                         for role in ("gateway", "redis", "prefill", "decode")}},
    "podMonitor": {"enabled": True},
    "keda": {"enabled": True, "prometheus": {"serverAddress": "http://prom:9090"}},
}


def _everything(values: dict) -> list[dict]:
    """What the chart renders and what the operator makes of its BatonService."""
    rendered = objects(values)
    (service,) = [o for o in rendered if o["kind"] == "BatonService"]
    return rendered + workloads.children("baton", NAMESPACE, read_spec(service["spec"], "x"), 2, 2)


def test_every_option_renders_and_validates():
    everything = _everything(EVERY_OPTION)
    for obj in everything:
        validate(obj)
    pods = {o["metadata"]["name"]: o["spec"]["template"] for o in everything
            if o["kind"] in ("Deployment", "StatefulSet")}
    assert {"prod-baton-operator", "baton-gateway", "baton-redis", "baton-prefill-0",
            "baton-decode"} <= set(pods)
    for name, template in pods.items():
        pod = template["spec"]
        assert pod["imagePullSecrets"] == [{"name": "registry"}], name
        for key in ("nodeSelector", "tolerations", "affinity", "topologySpreadConstraints",
                    "priorityClassName"):
            assert pod[key] == POD[key], (name, key)
        assert template["metadata"]["annotations"]["team.example/owner"] == "platform", name
        assert template["metadata"]["labels"]["team.example/tier"] == "gold", name
        main, sidecar = pod["containers"]
        assert sidecar == POD["extraContainers"][0], name
        assert {"name": "EXTRA", "value": "1"} in main["env"], name
        assert {"name": "extra", "mountPath": "/extra"} in main["volumeMounts"], name
        assert {"name": "extra", "emptyDir": {}} in pod["volumes"], name
    budgets = {o["metadata"]["name"]: o["spec"] for o in everything
               if o["kind"] == "PodDisruptionBudget"}
    assert budgets["prod-baton-operator"]["maxUnavailable"] == 0
    assert {budgets[f"baton-{r}"]["maxUnavailable"] for r in ("gateway", "redis", "prefill",
                                                              "decode")} == {2}


def test_pull_secrets_reach_every_pod_by_default_values_too():
    for obj in _everything({"imagePullSecrets": [{"name": "registry"}]}):
        if obj["kind"] in ("Deployment", "StatefulSet"):
            assert obj["spec"]["template"]["spec"]["imagePullSecrets"] == [{"name": "registry"}]


@pytest.mark.parametrize("pod, says", [
    ({"env": [{"name": "HOME", "value": "/"}]}, "operator.pod.env"),
    ({"volumes": [{"name": "tmp", "emptyDir": {}}]}, "operator.pod.volumes"),
    ({"extraContainers": [{"name": "operator", "image": "x"}]}, "operator.pod.extraContainers"),
    ({"labels": {"app.kubernetes.io/component": "x"}}, "operator.pod.labels"),
])
def test_the_operators_overlay_never_replaces_what_the_chart_sets(pod, says):
    with pytest.raises(helm_python.errors.HelmError, match=says):
        objects({"operator": {"pod": pod}})


def test_the_values_schema_checks_each_roles_pod():
    with helm_python.Chart.load(CHART) as chart:
        chart.validate_schema(EVERY_OPTION)
        for bad in ({"operator": {"nodeSelector": {"a": "b"}}},  # moved to operator.pod
                    {"operator": {"pod": {"nodeSelctor": {}}}},
                    {"service": {"spec": {"decode": {"pod": {"env": [{"value": "x"}]}}}}},
                    {"service": {"spec": {"prefill": {"podDisruptionBudget": {
                        "maxUnavailable": -1}}}}},
                    {"service": {"spec": {"imagePullSecrets": [{"name": "x"}]}}}):
            with pytest.raises(helm_python.errors.HelmError):
                chart.validate_schema(bad)
