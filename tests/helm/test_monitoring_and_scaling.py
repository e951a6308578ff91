"""The chart's PodMonitor and KEDA ScaledObject, and the HPA recipe of docs/operations.md:
each validates against its project's own schema (crds/README.md), points at what the
operator really makes, and reads series baton's pods really export."""

from __future__ import annotations

import re

import helm_python
import pytest
import yaml
from baton_operator import workloads
from baton_operator.spec import read_spec
from chart_render import CHART, NAMESPACE, ROOT, crd_schema, objects, validate
from test_metrics_docs import exported_names

KEDA = {"keda": {"enabled": True, "prometheus": {"serverAddress": "http://prom.monitoring:9090"}}}
OPERATIONS = ROOT / "docs" / "operations.md"
SERIES = re.compile(r"\b(?:vllm:|baton_)[a-z0-9_:]*[a-z0-9]")


def _one(rendered: list[dict], kind: str) -> dict:
    (obj,) = [o for o in rendered if o["kind"] == kind]
    return obj


def _pod_templates(rendered: list[dict]) -> dict[str, dict]:
    """Role -> pod template of the pods the operator makes from the chart's BatonService."""
    spec = read_spec(_one(rendered, "BatonService")["spec"], "unused")
    return {o["spec"]["template"]["metadata"]["labels"]["baton.dev/role"]: o["spec"]["template"]
            for o in workloads.children("baton", NAMESPACE, spec, 1, 1)
            if o["kind"] in ("Deployment", "StatefulSet")}


def _selects(selector: dict, labels: dict) -> bool:
    expressions = selector.get("matchExpressions", [])
    assert all(e["operator"] == "In" for e in expressions)
    return (selector.get("matchLabels", {}).items() <= labels.items()
            and all(labels.get(e["key"]) in e["values"] for e in expressions))


def test_the_pod_monitor_scrapes_every_pod_with_a_metrics_port():
    assert not [o for o in objects() if o["kind"] == "PodMonitor"]  # off by default
    rendered = objects({"podMonitor": {"enabled": True, "labels": {"release": "prometheus"},
                                       "scrapeTimeout": "10s"}})
    monitor = _one(rendered, "PodMonitor")
    validate(monitor)  # against prometheus-operator's own CRD
    assert monitor["metadata"]["labels"]["release"] == "prometheus"
    (endpoint,) = monitor["spec"]["podMetricsEndpoints"]
    assert (endpoint["path"], endpoint["interval"], endpoint["scrapeTimeout"]) == (
        "/metrics", "15s", "10s")
    for role, template in _pod_templates(rendered).items():
        ports = {p["name"] for p in template["spec"]["containers"][0]["ports"]}
        picked = _selects(monitor["spec"]["selector"], template["metadata"]["labels"])
        assert picked == (endpoint["port"] in ports), role  # every pod that has metrics
        assert picked == (role != "redis"), role


def test_the_scaled_object_resizes_a_pool_through_its_scale_subresource():
    assert not [o for o in objects() if o["kind"] == "ScaledObject"]  # off by default
    for pool, series in (("decode", "vllm:num_requests_waiting"),
                         ("prefill", "baton_prefill_queued_requests")):
        scaled = _one(objects({"keda": {**KEDA["keda"], "pool": pool}}), "ScaledObject")
        validate(scaled)  # against KEDA's own CRD
        target = scaled["spec"]["scaleTargetRef"]
        assert (target["apiVersion"], target["kind"], target["name"]) == (
            "baton.dev/v1alpha1", "BatonPool", f"baton-{pool}")  # the pool the operator makes
        (trigger,) = scaled["spec"]["triggers"]
        query = trigger["metadata"]["query"]
        assert SERIES.findall(query) == [series] and series in exported_names()
        # Over the pool's pods, by the labels a PodMonitor gives every series.
        assert f'namespace="{NAMESPACE}"' in query
        (pods,) = re.findall(r'pod=~"([^"]+)"', query)
        names = {"decode": "baton-decode-5d8c7b9f4-x2x9q", "prefill": "baton-prefill-1-0",
                 "gateway": "baton-gateway-6b7d9c8f5-q8r2t"}  # as their controllers name them
        assert {role for role, name in names.items() if re.fullmatch(pods, name)} == {pool}
    pool_crd = yaml.safe_load((CHART / "crds" / "baton.dev_batonpools.yaml").read_text())
    scale = pool_crd["spec"]["versions"][0]["subresources"]["scale"]
    assert scale["specReplicasPath"] == ".spec.replicas" and scale["labelSelectorPath"]


def test_the_scaled_object_takes_its_own_triggers_and_refuses_the_planner_beside_it():
    cron = {"type": "cron", "metadata": {"timezone": "UTC", "start": "0 8 * * *",
                                         "end": "0 20 * * *", "desiredReplicas": "4"}}
    scaled = _one(objects({"keda": {"enabled": True, "triggers": [cron]}}), "ScaledObject")
    validate(scaled)
    assert scaled["spec"]["triggers"] == [cron]
    with pytest.raises(helm_python.errors.HelmError, match="serverAddress"):
        objects({"keda": {"enabled": True}})
    with pytest.raises(helm_python.errors.HelmError, match="both set the pool's replicas"):
        objects({**KEDA, "service": {"spec": {"autoscaling": {"enabled": True}}}})


def _documented() -> list[dict]:
    """Every YAML document of the yaml blocks of docs/operations.md that is a mapping."""
    blocks = re.findall(r"```yaml\n(.*?)```", OPERATIONS.read_text(), re.DOTALL)
    return [doc for block in blocks for doc in yaml.safe_load_all(block) if isinstance(doc, dict)]


def _documented_kind(kind: str) -> list[dict]:
    return [doc for doc in _documented() if doc.get("kind") == kind]


def test_the_documented_hpa_scales_a_pool_on_a_series_the_pods_export():
    (hpa,) = _documented_kind("HorizontalPodAutoscaler")
    validate(hpa)  # autoscaling/v2, strictly
    assert hpa["spec"]["scaleTargetRef"]["kind"] == "BatonPool"
    assert crd_schema("BatonPool", hpa["spec"]["scaleTargetRef"]["apiVersion"]) is not None
    (adapter,) = [doc for doc in _documented() if "rules" in doc]  # prometheus-adapter's
    (rule,) = adapter["rules"]
    (series,) = SERIES.findall(rule["seriesQuery"])
    assert series in exported_names()
    # The name prometheus-adapter serves it under is the one the HPA asks for.
    served = re.sub(rule["name"]["matches"], rule["name"]["as"].replace("${1}", r"\1"), series)
    (metric,) = hpa["spec"]["metrics"]
    assert metric["type"] == "Pods" and metric["pods"]["metric"]["name"] == served


def test_the_documented_scaled_object_validates_and_reads_exported_series():
    documented = _documented_kind("ScaledObject")
    assert documented
    for scaled in documented:
        validate(scaled)
        assert scaled["spec"]["scaleTargetRef"]["kind"] == "BatonPool"
        for trigger in scaled["spec"]["triggers"]:
            names = SERIES.findall(trigger["metadata"].get("query", ""))
            assert names and set(names) <= exported_names()
