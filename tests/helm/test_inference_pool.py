"""``inferencePool.enabled``: the chart renders an InferencePool of the decode pods, its
endpoint picker and an HTTPRoute from a named Gateway, each valid against its project's own
CRD (tests/helm/crds) or Kubernetes' schemas; the operator then gives every decode pod the
OpenAI port the pool targets, and the picker reads the vLLM names the pods export."""

from __future__ import annotations

import pytest
import yaml
from baton.metrics import DecodeMetrics
from baton_operator import workloads
from baton_operator.spec import read_spec
from chart_render import NAMESPACE, objects, validate
from jsonschema import ValidationError
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

POOL = {"inferencePool": {"enabled": True,
                          "gateway": {"name": "inference-gateway", "namespace": "gateways"}}}


def one(rendered: list[dict], kind: str, name: str | None = None) -> dict:
    (found,) = [o for o in rendered if o["kind"] == kind
                and (name is None or o["metadata"]["name"] == name)]
    return found


def decode_pod(rendered: list[dict]) -> dict:
    """The decode pods' template as the operator makes it from the rendered BatonService."""
    service = one(rendered, "BatonService")
    spec = read_spec(service["spec"], "unused")
    children = workloads.children(service["metadata"]["name"], NAMESPACE, spec, 1, 2)
    return one(children, "Deployment", "baton-decode")["spec"]["template"]


def test_every_object_validates_against_its_projects_schema():
    rendered = objects(POOL)
    kinds = {o["kind"] for o in rendered}
    assert {"InferencePool", "HTTPRoute", "ConfigMap", "RoleBinding"} <= kinds
    for obj in rendered:
        validate(obj)
    # the CRDs are really checked: a field InferencePool v1 does not have fails
    pool = one(rendered, "InferencePool")
    pool["spec"]["extensionRef"] = pool["spec"].pop("endpointPickerRef")
    with pytest.raises(ValidationError):
        validate(pool)


def test_the_pool_selects_the_decode_pods_on_their_own_openai_port():
    rendered = objects(POOL)
    pool = one(rendered, "InferencePool")
    assert pool["apiVersion"] == "inference.networking.k8s.io/v1"
    template = decode_pod(rendered)
    assert pool["spec"]["selector"]["matchLabels"].items() <= template["metadata"]["labels"].items()
    (container,) = template["spec"]["containers"]
    (target,) = pool["spec"]["targetPorts"]
    http = next(port for port in container["ports"] if port["name"] == "http")
    assert http["containerPort"] == target["number"]
    args = container["args"]
    assert args[args.index("--http-port") + 1] == str(target["number"])
    assert args[args.index("--http-host") + 1] == "0.0.0.0"
    # the picker the pool names is the chart's, on its ext_proc port
    picker = one(rendered, "Service", pool["spec"]["endpointPickerRef"]["name"])
    assert {p["port"] for p in picker["spec"]["ports"]} >= {pool["spec"]["endpointPickerRef"]["port"]["number"]}


def test_the_route_goes_from_the_named_gateway_to_the_pool():
    rendered = objects(POOL)
    route = one(rendered, "HTTPRoute")
    (parent,) = route["spec"]["parentRefs"]
    assert (parent["kind"], parent["name"], parent["namespace"]) == ("Gateway", "inference-gateway",
                                                                     "gateways")
    (rule,) = route["spec"]["rules"]
    (backend,) = rule["backendRefs"]
    assert (backend["kind"], backend["name"]) == ("InferencePool", one(rendered, "InferencePool")[
        "metadata"]["name"])


def test_the_picker_reads_the_vllm_series_the_decode_pods_export():
    rendered = objects(POOL)
    picker = next(o for o in rendered if o["kind"] == "Deployment"
                  and o["metadata"]["labels"].get("app.kubernetes.io/component") == "endpoint-picker")
    (container,) = picker["spec"]["template"]["spec"]["containers"]
    assert f"--pool-name={one(rendered, 'InferencePool')['metadata']['name']}" in container["args"]
    assert f"--pool-namespace={NAMESPACE}" in container["args"]
    config_map = one(rendered, "ConfigMap", picker["spec"]["template"]["spec"]["volumes"][0][
        "configMap"]["name"])
    config = yaml.safe_load(config_map["data"]["epp-config.yaml"])
    assert config["kind"] == "EndpointPickerConfig"
    plugins = {plugin["type"]: plugin.get("parameters", {}) for plugin in config["plugins"]}
    assert {"prefix-cache-scorer", "queue-scorer", "kv-cache-utilization-scorer"} <= set(plugins)
    (engine,) = plugins["core-metrics-extractor"]["engineConfigs"]
    exported = {family.name for family in text_string_to_metric_families(
        generate_latest(DecodeMetrics(CollectorRegistry(), "m").registry).decode())}
    read = [engine[key] for key in ("queuedRequestsSpec", "runningRequestsSpec", "kvUsageSpec",
                                    "cacheInfoSpec")]
    assert set(read) <= exported
    assert engine["loraSpec"] == ""  # baton has no LoRA series: none is asked for


def test_the_decode_pods_openai_port_and_the_chains_are_reachable():
    rendered = objects(POOL)
    port = one(rendered, "InferencePool")["spec"]["targetPorts"][0]["number"]
    door = one(rendered, "NetworkPolicy", "baton-decode-openai")
    assert door["spec"]["podSelector"]["matchLabels"]["baton.dev/role"] == "decode"
    assert door["spec"]["ingress"][0]["ports"] == [{"protocol": "TCP", "port": port}]
    chains = one(rendered, "NetworkPolicy", "baton-prefill-from-decode")
    (rule,) = chains["spec"]["ingress"]
    assert rule["from"][0]["podSelector"]["matchLabels"]["baton.dev/role"] == "decode"


def test_off_by_default_the_decode_pods_serve_no_openai_port():
    rendered = objects()
    assert not {"InferencePool", "HTTPRoute"} & {o["kind"] for o in rendered}
    (container,) = decode_pod(rendered)["spec"]["containers"]
    assert "--http-port" not in container["args"]
    assert "http" not in {port["name"] for port in container["ports"]}
