"""The chart's model values: an hf:// model with its token Secret and cache claim, a pvc://
checkpoint, rendered by the real Helm library and, with what the operator makes of them,
validated against the Kubernetes schemas."""

from __future__ import annotations

import helm_python
import pytest
from baton_operator import workloads
from baton_operator.spec import read_spec
from chart_render import CHART, GPU_VALUES, NAMESPACE, objects, validate, values_file

HF_MODEL = {"uri": "hf://meta-llama/Llama-3.1-8B-Instruct@main",
            "tokenSecret": {"name": "hf-token", "key": "token"},
            "cache": {"claimName": "hf-cache"}, "servedModelName": ["llama"]}


def _children(values: dict) -> list[dict]:
    """The BatonService the chart renders, validated, and the objects the operator makes of it."""
    service = next(o for o in objects(values) if o["kind"] == "BatonService")
    validate(service)
    spec = read_spec(service["spec"], "registry.local/baton:test")
    children = workloads.children(service["metadata"]["name"], NAMESPACE, spec, 1, 2)
    for obj in children:
        validate(obj)
    return children


def _pods(children: list[dict]) -> dict[str, dict]:
    return {o["metadata"]["name"]: o["spec"]["template"]["spec"] for o in children
            if o["kind"] in ("Deployment", "StatefulSet") and "redis" not in o["metadata"]["name"]}


def test_an_hf_model_from_the_values_is_fetched_by_every_baton_pod():
    pods = _pods(_children({"service": {"spec": {
        "model": HF_MODEL, "prefill": {"maxModelLen": 16384},
        "decode": {"maxModelLen": 8192, "kvMemoryFraction": 0.85}}}}))
    assert set(pods) == {"baton-prefill-0", "baton-decode", "baton-gateway"}
    for name, pod in pods.items():
        (fetch,) = pod["initContainers"]
        assert fetch["args"][1:4] == ["meta-llama/Llama-3.1-8B-Instruct", "--revision", "main"]
        token = next(e for e in fetch["env"] if e["name"] == "HF_TOKEN")
        assert token["valueFrom"]["secretKeyRef"] == {"name": "hf-token", "key": "token"}
        security = fetch["securityContext"]  # restricted, as the servers are
        assert security["readOnlyRootFilesystem"] and not security["allowPrivilegeEscalation"]
        assert security["capabilities"] == {"drop": ["ALL"]}, name
        args = pod["containers"][0]["args"]
        assert args[args.index("--model-served-model-name") + 1] == "llama"
    decode_args = pods["baton-decode"]["containers"][0]["args"]
    assert decode_args[decode_args.index("--model-max-model-len") + 1] == "8192"
    assert decode_args[decode_args.index("--kv-memory-fraction") + 1] == "0.85"


def test_the_gpu_values_serve_a_checkpoint_on_a_claim():
    pods = _pods(_children(values_file(GPU_VALUES)))
    for pod in pods.values():
        assert {"name": "model", "persistentVolumeClaim": {
            "claimName": "baton-models", "readOnly": True}} in pod["volumes"]
        args = pod["containers"][0]["args"]
        assert args[args.index("--model-path") + 1] == "/models/pvc/llama-3.1-8b-instruct"


@pytest.mark.parametrize("model", [
    {"uri": "s3://bucket/llama"}, {"uri": "hf://llama"}, {"uri": "pvc://Models/x"},
    {"uri": "hf://acme/coder", "tokenSecret": {"key": "token"}},
    {"uri": "hf://acme/coder", "cache": {"claim": "x"}},
])
def test_the_values_schema_refuses_a_bad_model(model):
    with helm_python.Chart.load(CHART) as chart:
        chart.validate_schema({"service": {"spec": {"model": HF_MODEL}}})
        with pytest.raises(helm_python.errors.HelmError):
            chart.validate_schema({"service": {"spec": {"model": model}}})
