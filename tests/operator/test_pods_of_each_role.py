"""What each role's pods get beside what the operator builds (scheduling, pull secrets, an
overlay), their PodDisruptionBudgets, and children written by server-side apply: fields
another manager set survive a reconcile. Against kmock's emulator (emulated_cluster.py)."""

from __future__ import annotations

import pytest
from baton_operator.reconcile import FIELD_MANAGER, Reconciler
from baton_operator.spec import InvalidSpec
from emulated_cluster import create_service

NS = "serving"
SPEC = {"prefill": {"chains": 2, "ranksPerChain": 3}, "decode": {"replicas": 2},
        "mtls": {"secretName": "demo-mtls"}}
GPU_NODES = {"nvidia.com/gpu.present": "true"}
GPU_TOLERATION = {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}
ROLES = ("gateway", "redis", "prefill", "decode")


@pytest.fixture
def reconciler(cluster):
    return Reconciler(cluster.kube, "registry.local/baton:test")


def _reconcile(cluster, reconciler):
    return reconciler.reconcile(cluster.kube.get("BatonService", NS, "demo"))


def _templates(cluster) -> dict[str, dict]:
    """Role -> the pod template of one of its Deployments or StatefulSets, as written."""
    found = {}
    for kind in ("Deployment", "StatefulSet"):
        for obj in cluster.kube.list(kind, NS, "baton.dev/service=demo"):
            template = obj["spec"]["template"]
            found[template["metadata"]["labels"]["baton.dev/role"]] = template
    assert set(found) == set(ROLES)
    return found


def _budgets(cluster) -> dict[str, dict]:
    return {b["metadata"]["name"]: b["spec"]
            for b in cluster.kube.list("PodDisruptionBudget", NS, "baton.dev/service=demo")}


def test_gpu_scheduling_reaches_only_the_roles_that_ask_for_it(cluster, reconciler):
    spread = [{"maxSkew": 1, "topologyKey": "kubernetes.io/hostname",
               "whenUnsatisfiable": "ScheduleAnyway",
               "labelSelector": {"matchLabels": {"baton.dev/role": "decode"}}}]
    affinity = {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {
        "nodeSelectorTerms": [{"matchExpressions": [
            {"key": "gpu.product", "operator": "In", "values": ["H100"]}]}]}}}
    gpu_pod = {"nodeSelector": GPU_NODES, "tolerations": [GPU_TOLERATION]}
    create_service(cluster.kube, "demo", {
        **SPEC, "nodeSelector": {"pool": "serving"},  # every role's
        "prefill": {**SPEC["prefill"], "pod": {**gpu_pod, "priorityClassName": "batch-high"}},
        "decode": {**SPEC["decode"], "pod": {**gpu_pod, "affinity": affinity,
                                             "topologySpreadConstraints": spread,
                                             "priorityClassName": "serving-high"}},
        "gateway": {"pod": {"nodeSelector": {"pool": "edge"}}}})
    _reconcile(cluster, reconciler)
    pods = {role: template["spec"] for role, template in _templates(cluster).items()}

    for role in ("prefill", "decode"):
        assert pods[role]["nodeSelector"] == {"pool": "serving", **GPU_NODES}
        assert pods[role]["tolerations"] == [GPU_TOLERATION]
    assert pods["decode"]["affinity"] == affinity
    assert pods["decode"]["topologySpreadConstraints"] == spread
    assert pods["decode"]["priorityClassName"] == "serving-high"
    assert pods["prefill"]["priorityClassName"] == "batch-high"
    assert pods["gateway"]["nodeSelector"] == {"pool": "edge"}  # its own wins over the service's
    assert pods["redis"]["nodeSelector"] == {"pool": "serving"}
    for role in ("gateway", "redis"):  # off the GPU nodes
        assert "tolerations" not in pods[role] and "affinity" not in pods[role]
        assert "priorityClassName" not in pods[role]


def test_pull_secrets_and_each_roles_overlay_reach_its_pods(cluster, reconciler):
    sidecar = {"name": "log-shipper", "image": "fluent/fluent-bit:3.1",
               "volumeMounts": [{"name": "logs", "mountPath": "/logs"}]}
    create_service(cluster.kube, "demo", {
        **SPEC, "imagePullSecrets": [{"name": "registry-a"}, {"name": "registry-b"}],
        "decode": {**SPEC["decode"], "pod": {
            "env": [{"name": "TRANSFORMERS_VERBOSITY", "value": "error"}],
            "volumes": [{"name": "logs", "emptyDir": {}}],
            "volumeMounts": [{"name": "logs", "mountPath": "/logs"}],
            "annotations": {"team.example/owner": "inference"},
            "labels": {"team.example/tier": "gold"},
            "extraContainers": [sidecar]}}})
    _reconcile(cluster, reconciler)
    templates = _templates(cluster)

    for role, template in templates.items():
        assert template["spec"]["imagePullSecrets"] == [{"name": "registry-a"},
                                                        {"name": "registry-b"}], role
    decode = templates["decode"]
    main, added = decode["spec"]["containers"]
    assert main["name"] == "decode" and added == sidecar
    assert {"name": "TRANSFORMERS_VERBOSITY", "value": "error"} in main["env"]
    assert {"name": "logs", "mountPath": "/logs"} in main["volumeMounts"]
    assert {"name": "logs", "emptyDir": {}} in decode["spec"]["volumes"]
    assert {"name": "mtls", "mountPath": "/etc/baton/mtls", "readOnly": True} in main["volumeMounts"]
    assert decode["metadata"]["annotations"] == {"team.example/owner": "inference"}
    assert decode["metadata"]["labels"]["team.example/tier"] == "gold"
    assert decode["metadata"]["labels"]["baton.dev/role"] == "decode"
    for role in ("gateway", "prefill", "redis"):  # the overlay is the decode pods' alone
        assert len(templates[role]["spec"]["containers"]) == 1
        assert "team.example/tier" not in templates[role]["metadata"]["labels"]


@pytest.mark.parametrize("pod, says", [
    ({"env": [{"name": "POD_IP", "value": "x"}]}, "env 'POD_IP' is the operator's own"),
    ({"volumes": [{"name": "mtls", "emptyDir": {}}]}, "volume 'mtls' is the operator's own"),
    ({"volumeMounts": [{"name": "x", "mountPath": "/tmp"}]}, "mountPath '/tmp'"),
    ({"labels": {"baton.dev/role": "gateway"}}, "label 'baton.dev/role' is the operator's own"),
    ({"extraContainers": [{"name": "decode", "image": "x"}]}, "container 'decode'"),
    ({"env": [{"name": "A"}, {"name": "A"}]}, "name 'A' is given twice"),
    ({"nodeSelctor": {}}, "spec.decode.pod has no key nodeSelctor"),
])
def test_an_overlay_never_replaces_what_the_operator_sets(cluster, reconciler, pod, says):
    service = create_service(cluster.kube, "demo", {**SPEC, "decode": {"pod": pod}})
    with pytest.raises(InvalidSpec, match=says):
        reconciler.reconcile(service)
    assert cluster.kube.list("Deployment", NS, "baton.dev/service=demo") == []


def test_one_budget_per_role_and_one_over_every_chain(cluster, reconciler):
    create_service(cluster.kube, "demo", {
        **SPEC, "decode": {**SPEC["decode"], "podDisruptionBudget": {"maxUnavailable": 2}}})
    _reconcile(cluster, reconciler)
    budgets = _budgets(cluster)
    assert set(budgets) == {f"demo-{role}" for role in ROLES}
    assert budgets["demo-decode"]["maxUnavailable"] == 2
    # Both chains' six ranks under one budget of one pod: a drain stops one chain at most.
    prefill = budgets["demo-prefill"]
    assert prefill["maxUnavailable"] == 1
    assert prefill["selector"]["matchLabels"] == {"baton.dev/service": "demo",
                                                  "baton.dev/role": "prefill"}
    for role, template in _templates(cluster).items():  # each budget selects its role's pods
        selector = budgets[f"demo-{role}"]["selector"]["matchLabels"].items()
        assert selector <= template["metadata"]["labels"].items()
        others = [t for r, t in _templates(cluster).items() if r != role]
        assert not any(selector <= t["metadata"]["labels"].items() for t in others)
    assert all(b["unhealthyPodEvictionPolicy"] == "AlwaysAllow" for b in budgets.values())

    # A role's budget turned off, and Redis gone external: their budgets are pruned.
    cluster.kube.patch("BatonService", NS, "demo", {"spec": {
        "gateway": {"podDisruptionBudget": {"enabled": False}},
        "redis": {"mode": "external", "external": {"urlSecretRef": {"name": "redis-url"}}}}})
    _reconcile(cluster, reconciler)
    assert set(_budgets(cluster)) == {"demo-prefill", "demo-decode"}
    with pytest.raises(InvalidSpec, match="spec.decode.podDisruptionBudget.maxUnavailable"):
        reconciler.reconcile(create_service(cluster.kube, "bad", {
            **SPEC, "decode": {"podDisruptionBudget": {"maxUnavailable": -1}}}))


def test_what_another_manager_set_survives_a_reconcile(cluster, reconciler):
    kube = cluster.kube
    create_service(kube, "demo", {**SPEC, "decode": {
        **SPEC["decode"], "pod": {"nodeSelector": GPU_NODES}}})
    _reconcile(cluster, reconciler)
    # `kubectl rollout restart` and a cost tool, with patches of their own.
    restarted = {"kubectl.kubernetes.io/restartedAt": "2025-01-01T00:00:00Z"}
    kube.patch("Deployment", NS, "demo-decode", {
        "metadata": {"labels": {"cost.example/center": "ml"}},
        "spec": {"template": {"metadata": {"annotations": restarted}}}})

    # The spec changes: the operator writes the Deployment again.
    kube.patch("BatonService", NS, "demo", {"metadata": {"generation": 2}, "spec": {
        "decode": {"tokenBudget": 256}}})
    _reconcile(cluster, reconciler)
    decode = kube.get("Deployment", NS, "demo-decode")
    args = decode["spec"]["template"]["spec"]["containers"][0]["args"]
    assert args[args.index("--scheduler-token-budget") + 1] == "256"
    assert decode["spec"]["template"]["metadata"]["annotations"] == restarted
    assert decode["metadata"]["labels"]["cost.example/center"] == "ml"

    # Only a field of the operator's is dropped (what it applies is then within the live
    # object): it goes, and the others' fields stay.
    kube.patch("BatonService", NS, "demo", {"metadata": {"generation": 3}, "spec": {
        "decode": {"pod": None}}})
    _reconcile(cluster, reconciler)
    decode = kube.get("Deployment", NS, "demo-decode")
    assert "nodeSelector" not in decode["spec"]["template"]["spec"]
    assert decode["spec"]["template"]["metadata"]["annotations"] == restarted
    (entry,) = [e for e in decode["metadata"]["managedFields"] if e["manager"] == FIELD_MANAGER]
    assert entry["operation"] == "Apply"

    # A field the operator owns, changed by someone else, is set back.
    kube.patch("Deployment", NS, "demo-decode", {"spec": {"template": {"spec": {
        "terminationGracePeriodSeconds": 1}}}})
    _reconcile(cluster, reconciler)
    decode = kube.get("Deployment", NS, "demo-decode")
    assert decode["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] > 1
    assert decode["spec"]["template"]["metadata"]["annotations"] == restarted


def test_pools_report_ready_and_the_generation_they_reflect(cluster, reconciler):
    create_service(cluster.kube, "demo", {**SPEC, "prefill": {"chains": 1, "ranksPerChain": 2}})
    cluster.kube.create({"apiVersion": "baton.dev/v1alpha1", "kind": "BatonPool", "metadata": {
        "name": "demo-decode", "namespace": NS, "generation": 3}, "spec": {
        "service": "demo", "role": "decode", "replicas": 2}})
    _reconcile(cluster, reconciler)
    status = cluster.kube.get("BatonPool", NS, "demo-decode")["status"]
    assert status["observedGeneration"] == 3
    (ready,) = status["conditions"]
    assert (ready["type"], ready["status"], ready["message"]) == ("Ready", "False",
                                                                  "0 of 2 pods ready")
    assert ready["observedGeneration"] == 3

    cluster.kube.patch("StatefulSet", NS, "demo-prefill-0", {"status": {"readyReplicas": 2}},
                       "status")
    _reconcile(cluster, reconciler)
    prefill = cluster.kube.get("BatonPool", NS, "demo-prefill")["status"]["conditions"][0]
    assert (prefill["status"], prefill["message"]) == ("True", "1 of 1 chains ready")
