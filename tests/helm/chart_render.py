"""Render the chart with the real Helm library and check objects against Kubernetes schemas."""

from __future__ import annotations

import copy
import functools
from pathlib import Path

import helm_python
import jsonschema
import kubernetes_validate
import yaml

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "helm" / "baton"
GPU_VALUES = CHART / "values-gpu.yaml"
OTHER_CRDS = Path(__file__).resolve().parent / "crds"  # PodMonitor, ScaledObject
KUBE_VERSION = "1.30.0"  # the oldest minor the chart supports well (pod-index label: 1.28+)
RELEASE, NAMESPACE = "prod", "serving"


def values_file(path: Path | None) -> dict:
    return yaml.safe_load(path.read_text()) if path else {}


def render(values: dict | None = None) -> dict[str, str]:
    """Template path -> rendered text, as `helm template` would print it."""
    with helm_python.Chart.load(CHART) as chart:
        return chart.render(values or {}, name=RELEASE, namespace=NAMESPACE)


def objects(values: dict | None = None) -> list[dict]:
    """Every object an install creates: the CRDs, then the templates' objects."""
    docs = [yaml.safe_load(p.read_text()) for p in sorted((CHART / "crds").glob("*.yaml"))]
    for path, text in sorted(render(values).items()):
        if path.endswith(".yaml"):
            docs += [d for d in yaml.safe_load_all(text) if d]
    return docs


def _closed(schema: dict) -> dict:
    """The CRD schema with unknown fields made errors (the API server would silently prune them)."""
    schema = copy.deepcopy(schema)

    def close(node):
        if isinstance(node, dict):
            if (node.get("type") == "object" and "properties" in node
                    and "additionalProperties" not in node
                    and not node.get("x-kubernetes-preserve-unknown-fields")):
                node["additionalProperties"] = False
            for value in node.values():
                close(value)
        elif isinstance(node, list):
            for value in node:
                close(value)

    close(schema)
    schema["properties"]["metadata"] = {"type": "object"}
    return schema


# Other projects' CRDs for kinds the chart renders (each file names its project and release).
PROJECT_CRDS = Path(__file__).resolve().parent / "crds"


@functools.cache
def _crds() -> dict[tuple[str, str], dict]:
    """(apiVersion, kind) -> its schema, of baton's CRDs and the other projects'."""
    found = {}
    for path in [*(CHART / "crds").glob("*.yaml"), *PROJECT_CRDS.glob("*.yaml")]:
        crd = yaml.safe_load(path.read_text())
        for version in crd["spec"]["versions"]:
            found[f"{crd['spec']['group']}/{version['name']}", crd["spec"]["names"]["kind"]] = \
                version["schema"]["openAPIV3Schema"]
    return found


def crd_schema(kind: str, api_version: str = "baton.dev/v1alpha1") -> dict:
    return _closed(_crds()[api_version, kind])


def validate(obj: dict) -> None:
    """Built-in kinds against Kubernetes' own schemas (strict: unknown fields fail); kinds of
    a CRD (baton's, or another project's kept in ``PROJECT_CRDS``) against its OpenAPI schema
    (CEL rules are the API server's job)."""
    if (obj["apiVersion"], obj["kind"]) in _crds():
        # OpenAPI v3.0 schemas use draft-4 style exclusiveMinimum/Maximum booleans.
        jsonschema.Draft4Validator(crd_schema(obj["kind"], obj["apiVersion"])).validate(obj)
    else:
        kubernetes_validate.validate(obj, KUBE_VERSION, strict=True)
