"""The chart's NetworkPolicies, on by default: every flow baton's pods need is admitted
and nothing else reaches them.

Flows are checked between the pods the operator actually builds from the chart's
BatonService (their labels and container ports), under NetworkPolicy's ingress rules:
a pod no policy selects admits anything; a selected pod admits a connection that some
rule of a selecting policy matches by port and by peer (no peers = from anywhere).
"""

from __future__ import annotations

import pytest
from baton.config import HttpConfig
from baton_operator import workloads
from baton_operator.spec import read_spec
from chart_render import NAMESPACE, objects

OUTSIDE = None  # a client that is none of the service's pods (another namespace, a node)
PROMETHEUS = {"app.kubernetes.io/name": "prometheus"}
MONITORING = {"kubernetes.io/metadata.name": "monitoring"}  # the namespace's own label
APPS = {"kubernetes.io/metadata.name": "apps"}
NCCL_PORT = 45123  # NCCL and gloo pick their own ports between ranks


def _policies(values: dict) -> list[dict]:
    return [o for o in objects(values) if o["kind"] == "NetworkPolicy"]


def _pods(values: dict) -> dict[str, tuple[dict, dict[str, int]]]:
    """Role -> (pod labels, container port by name) of the pods the operator makes."""
    service = next(o for o in objects(values) if o["kind"] == "BatonService")
    pods = {}
    for obj in workloads.children("baton", NAMESPACE, read_spec(service["spec"], "unused"), 1, 1):
        if obj["kind"] in ("Deployment", "StatefulSet"):
            template = obj["spec"]["template"]
            container = template["spec"]["containers"][0]
            pods[template["metadata"]["labels"]["baton.dev/role"]] = (
                template["metadata"]["labels"],
                {p["name"]: p["containerPort"] for p in container["ports"]})
    return pods


def _selects(selector: dict, labels: dict) -> bool:
    return selector.get("matchLabels", {}).items() <= labels.items()


def _peer_admits(peer: dict, source: dict, source_namespace: dict | None) -> bool:
    if set(peer) == {"podSelector"}:  # pods of the policy's own namespace
        return source_namespace is None and _selects(peer["podSelector"], source)
    if set(peer) == {"namespaceSelector"}:  # any pod of the namespaces selected
        return source_namespace is not None and _selects(peer["namespaceSelector"],
                                                         source_namespace)
    raise AssertionError(f"peer {peer} is not modelled here")


def admitted(policies: list[dict], source: dict | None, target: dict, port: int,
             source_namespace: dict | None = None) -> bool:
    """Whether a connection from pod labels ``source`` (OUTSIDE: none of the namespace's
    pods) in the namespace labelled ``source_namespace`` (None: the service's own) to
    ``port`` of the pod labelled ``target`` gets in."""
    selecting = [p for p in policies if _selects(p["spec"]["podSelector"], target)]
    if not selecting:
        return True
    for policy in selecting:
        for rule in policy["spec"].get("ingress", []):
            if "ports" in rule and port not in [p["port"] for p in rule["ports"]]:
                continue
            peers = rule.get("from")
            if not peers:
                return True
            if source is not None and any(_peer_admits(peer, source, source_namespace)
                                          for peer in peers):
                return True
    return False


def test_on_by_default_ingress_only():
    policies = _policies({})
    assert {p["metadata"]["name"] for p in policies} == {
        "baton-gateway", "baton-decode", "baton-prefill", "baton-redis"}
    # Egress is not restricted: DNS, the API server (the operator, which no policy
    # selects), an external Redis and model downloads stay reachable.
    assert all(p["spec"]["policyTypes"] == ["Ingress"] for p in policies)
    operator = next(o for o in objects({}) if o["kind"] == "Deployment")
    labels = operator["spec"]["template"]["metadata"]["labels"]
    assert not [p for p in policies if _selects(p["spec"]["podSelector"], labels)]
    assert _policies({"networkPolicy": {"enabled": False}}) == []


def test_every_flow_the_pods_need_is_admitted_and_no_other():
    values = {"networkPolicy": {"metricsFrom": [{"podSelector": {"matchLabels": PROMETHEUS}}]}}
    policies, pods = _policies(values), _pods(values)
    labels = {role: pod_labels for role, (pod_labels, _) in pods.items()}
    port = {role: ports for role, (_, ports) in pods.items()}
    needed = [
        (OUTSIDE, "gateway", port["gateway"]["grpc"]),  # clients, both APIs
        (OUTSIDE, "gateway", port["gateway"]["http"]),
        ("gateway", "decode", port["decode"]["grpc"]),
        ("gateway", "prefill", port["prefill"]["grpc"]),
        ("prefill", "decode", port["decode"]["grpc"]),  # the chain's tail pushes KV
        ("prefill", "prefill", port["prefill"]["rendezvous"]),
        ("prefill", "prefill", NCCL_PORT),
        *[(role, "redis", port["redis"]["redis"]) for role in ("gateway", "prefill", "decode")],
        *[(PROMETHEUS, role, port[role]["metrics"]) for role in ("gateway", "prefill", "decode")],
    ]
    refused = [
        (OUTSIDE, "decode", port["decode"]["grpc"]),
        (OUTSIDE, "prefill", port["prefill"]["grpc"]),
        (OUTSIDE, "prefill", port["prefill"]["rendezvous"]),
        (OUTSIDE, "redis", port["redis"]["redis"]),
        (OUTSIDE, "decode", port["decode"]["metrics"]),  # only metricsFrom scrapes
        ("decode", "prefill", port["prefill"]["grpc"]),
        ("gateway", "prefill", port["prefill"]["rendezvous"]),
        ("decode", "prefill", NCCL_PORT),
    ]

    def source(who):
        return labels.get(who, who) if isinstance(who, str) else who

    for who, role, number in needed:
        assert admitted(policies, source(who), labels[role], number), (who, role, number)
    for who, role, number in refused:
        assert not admitted(policies, source(who), labels[role], number), (who, role, number)
    # The kubelet's probes (the metrics port) come from the node, not a pod: most CNIs
    # admit them whatever the policy; docs/operations.md says what to do where not.


def _service_rules(policy: dict) -> list[dict]:
    """A policy's rules but the one for the metrics port (test_metrics_are_scraped_...)."""
    return [rule for rule in policy["spec"]["ingress"]
            if [p["port"] for p in rule.get("ports", [])] != [workloads.METRICS_PORT]]


def test_policy_ports_are_the_operators_ports():
    policies = {p["metadata"]["name"]: p for p in _policies({})}

    def sources(role):
        rules = _service_rules(policies[f"baton-{role}"])
        return [sorted(peer["podSelector"]["matchLabels"]["baton.dev/role"]
                       for peer in rule.get("from", [])) for rule in rules]

    def ports(role):
        return [p["port"] for rule in _service_rules(policies[f"baton-{role}"])
                for p in rule.get("ports", [])]

    assert "from" not in policies["baton-gateway"]["spec"]["ingress"][0]  # clients: anyone
    assert sources("decode") == [["gateway", "prefill"]]
    assert sources("prefill") == [["gateway"], ["prefill"]]  # ranks meet on any port
    assert sources("redis") == [["decode", "gateway", "prefill"]]
    assert ports("gateway") == [workloads.GATEWAY_PORT, HttpConfig().port]
    assert ports("decode") == [workloads.DECODE_PORT]
    assert ports("prefill") == [workloads.PREFILL_PORT]
    assert ports("redis") == [workloads.REDIS_PORT]


def _gateway_values(gateway: dict | None, clients_from: list | None = None) -> dict:
    return {"service": {"spec": {"gateway": gateway}},
            "networkPolicy": {"clientsFrom": clients_from or []}}


def _gateway_policy_and_pod(values: dict) -> tuple[dict, dict]:
    """The chart's gateway NetworkPolicy and the gateway container the operator makes."""
    rendered = objects(values)
    policy = next(o for o in rendered if o["metadata"]["name"] == "baton-gateway"
                  and o["kind"] == "NetworkPolicy")
    service = next(o for o in rendered if o["kind"] == "BatonService")
    children = workloads.children("baton", NAMESPACE, read_spec(service["spec"], "unused"), 1, 1)
    deployment = next(o for o in children if o["metadata"]["name"] == "baton-gateway"
                      and o["kind"] == "Deployment")
    return policy, deployment["spec"]["template"]["spec"]["containers"][0]


@pytest.mark.parametrize("gateway, http_port", [
    ({"http": {"port": 8080}}, 8080),
    ({"http": None}, HttpConfig().port),  # values without it: the template's and the gateway's default
    ({"http": {"enabled": False}}, None),
])
def test_clients_reach_the_http_port_exactly_as_the_grpc_port(gateway, http_port):
    clients = [{"namespaceSelector": {"matchLabels": {"team": "apps"}}}]
    for clients_from in (clients, []):
        policy, container = _gateway_policy_and_pod(_gateway_values(gateway, clients_from))
        (rule,) = _service_rules(policy)  # one rule: the same peers for every client port
        wanted = [workloads.GATEWAY_PORT] + ([http_port] if http_port else [])
        assert [p["port"] for p in rule["ports"]] == wanted
        assert rule.get("from", []) == clients_from  # none: anyone
        # The port the policy opens is the one the operator gives the container.
        assert {p["name"]: p["containerPort"] for p in container["ports"]}.get("http") == http_port


@pytest.mark.parametrize("autoscaling", [True, False])
def test_the_operator_scrapes_the_pods_only_when_it_autoscales(autoscaling):
    values = {"service": {"spec": {"autoscaling": {"enabled": autoscaling}}}}
    policies, pods = _policies(values), _pods(values)
    operator = next(o for o in objects(values) if o["kind"] == "Deployment")
    operator_labels = operator["spec"]["template"]["metadata"]["labels"]
    for role in ("gateway", "prefill", "decode"):
        labels, ports = pods[role]
        assert admitted(policies, operator_labels, labels, ports["metrics"]) == autoscaling, role
        assert not admitted(policies, operator_labels, labels, ports["grpc"]) or role == "gateway"


@pytest.mark.parametrize("metrics_from, scrapers", [
    (None, [MONITORING]),  # the default: Prometheus in the namespace `monitoring`
    ([{"namespaceSelector": {"matchLabels": {"team": "obs"}}}], [{"team": "obs"}]),
    ([], [MONITORING, APPS, None]),  # empty: anyone, never nobody
])
def test_prometheus_scrapes_every_pod_by_default(metrics_from, scrapers):
    values = {} if metrics_from is None else {"networkPolicy": {"metricsFrom": metrics_from}}
    policies, pods = _policies(values), _pods(values)
    refused = [ns for ns in (MONITORING, APPS) if ns not in scrapers]
    for role in ("gateway", "prefill", "decode"):
        labels, ports = pods[role]
        for namespace in scrapers:
            assert admitted(policies, PROMETHEUS, labels, ports["metrics"], namespace), role
        for namespace in refused:
            assert not admitted(policies, PROMETHEUS, labels, ports["metrics"], namespace), role
        # The metrics port only: Prometheus's namespace reaches no other port.
        assert not admitted(policies, PROMETHEUS, labels, ports["grpc"], MONITORING) \
            or role == "gateway"
