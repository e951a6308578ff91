"""What a role's pods get beside what the operator builds: scheduling (node selector,
tolerations, affinity, topology spread, priority class), pull secrets, and an overlay of
environment variables, volumes and their mounts, annotations, labels and extra containers.

One reader (``read``, from ``spec.<role>.pod``; the CRD's schema of it is one block of
``crds/batonservice.yaml``) and one writer (``apply``) serve every role the operator runs,
gateway, prefill, decode and Redis alike; the chart renders the operator's own pod from the
same keys (``helm/baton/templates/_pod.tpl``).

The overlay adds and never replaces: a name the operator already uses in the pod (an
environment variable, a volume, a mount path, a container, a label or an annotation) is
refused, because the pod would then lose what the operator needs (a label its selector
reads, the mTLS volume), and because server-side apply refuses two list items with one key.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any

# spec key -> (field name, type): maps of strings, lists of objects, objects, strings.
KEYS = {
    "nodeSelector": ("node_selector", dict), "tolerations": ("tolerations", list),
    "affinity": ("affinity", dict), "topologySpreadConstraints": ("topology_spread", list),
    "priorityClassName": ("priority_class_name", str), "annotations": ("annotations", dict),
    "labels": ("labels", dict), "env": ("env", list), "volumes": ("volumes", list),
    "volumeMounts": ("volume_mounts", list), "extraContainers": ("extra_containers", list),
}
STRING_MAPS = ("nodeSelector", "annotations", "labels")


@dataclass(frozen=True)
class PodOverlay:
    node_selector: dict[str, str] = field(default_factory=dict)
    tolerations: list[dict] = field(default_factory=list)
    affinity: dict = field(default_factory=dict)
    topology_spread: list[dict] = field(default_factory=list)
    priority_class_name: str = ""
    annotations: dict[str, str] = field(default_factory=dict)
    labels: dict[str, str] = field(default_factory=dict)
    env: list[dict] = field(default_factory=list)  # on the role's own container
    volumes: list[dict] = field(default_factory=list)
    volume_mounts: list[dict] = field(default_factory=list)  # on the role's own container
    extra_containers: list[dict] = field(default_factory=list)  # sidecars, as given


def read(pod: Any, where: str, node_selector: dict | None = None,
         tolerations: list | None = None) -> PodOverlay:
    """``spec.<role>.pod`` checked; ``node_selector`` and ``tolerations`` are the
    service-wide ones (``spec.nodeSelector``, ``spec.tolerations``), which every role takes
    beside its own (its own nodeSelector keys winning). Raises ``TypeError`` or
    ``ValueError`` naming the bad key."""
    pod = pod or {}
    if not isinstance(pod, dict):
        raise TypeError(f"{where} must be an object, got {pod!r}")
    unknown = set(pod) - set(KEYS)
    if unknown:
        raise ValueError(f"{where} has no key {', '.join(sorted(unknown))} "
                         f"(it takes {', '.join(KEYS)})")
    values: dict[str, Any] = {}
    for key, (name, kind) in KEYS.items():
        value = pod.get(key)
        if value is None:
            continue
        if not isinstance(value, kind):
            raise TypeError(f"{where}.{key} must be a {kind.__name__}, got {value!r}")
        if key in STRING_MAPS and not all(isinstance(v, str) for v in value.values()):
            raise ValueError(f"{where}.{key} takes string values, got {value!r}")
        if kind is list and not all(isinstance(item, dict) for item in value):
            raise ValueError(f"{where}.{key} takes objects, got {value!r}")
        values[name] = value
    for key in ("env", "volumes", "extraContainers"):
        _unique(pod.get(key) or [], "name", f"{where}.{key}")
    _unique(pod.get("volumeMounts") or [], "mountPath", f"{where}.volumeMounts")
    values["node_selector"] = {**(node_selector or {}), **values.get("node_selector", {})}
    values["tolerations"] = [*(tolerations or []), *values.get("tolerations", [])]
    return PodOverlay(**values)


def pull_secrets(secrets: Any, where: str) -> list[str]:
    """The Secret names of an ``imagePullSecrets`` list (``[{name: ...}]``)."""
    secrets = secrets or []
    if not isinstance(secrets, list) or not all(
            isinstance(s, dict) and isinstance(s.get("name"), str) and s["name"] for s in secrets):
        raise ValueError(f"{where} must be a list of {{name: <Secret>}}, got {secrets!r}")
    return [s["name"] for s in secrets]


def _unique(items: list[dict], key: str, where: str) -> None:
    seen = set()
    for item in items:
        if not item.get(key):
            raise ValueError(f"{where}: every item needs a {key}, got {item!r}")
        if item[key] in seen:
            raise ValueError(f"{where}: {key} {item[key]!r} is given twice")
        seen.add(item[key])


def _add(existing: list[dict], added: list[dict], key: str, what: str) -> list[dict]:
    taken = {item[key] for item in existing}
    clash = [item[key] for item in added if item[key] in taken]
    if clash:
        raise ValueError(f"{what} {', '.join(map(repr, clash))} is the operator's own")
    return [*existing, *added]


def _add_map(existing: dict, added: dict, what: str) -> dict:
    clash = sorted(set(existing) & set(added))
    if clash:
        raise ValueError(f"{what} {', '.join(map(repr, clash))} is the operator's own")
    return {**existing, **added}


def apply(template: dict, overlay: PodOverlay, pull_secrets: list[str]) -> dict:
    """``template`` (a pod template whose first container is the role's own) with the
    overlay and the image pull secrets added. Raises ``ValueError`` on a name the
    operator already uses."""
    metadata, pod = dict(template["metadata"]), dict(template["spec"])
    main, *others = pod["containers"]
    main = dict(main)
    main["env"] = _add(main.get("env", []), overlay.env, "name", "env")
    main["volumeMounts"] = _add(main.get("volumeMounts", []), overlay.volume_mounts,
                                "mountPath", "volumeMounts: mountPath")
    names = [{"name": c["name"]} for c in [main, *others, *pod.get("initContainers", [])]]
    _add(names, overlay.extra_containers, "name", "extraContainers: container")
    pod["containers"] = [main, *others, *overlay.extra_containers]
    pod["volumes"] = _add(pod.get("volumes", []), overlay.volumes, "name", "volumes: volume")
    metadata["labels"] = _add_map(metadata.get("labels", {}), overlay.labels, "labels: label")
    annotations = _add_map(metadata.get("annotations", {}), overlay.annotations,
                           "annotations: annotation")
    if annotations:
        metadata["annotations"] = annotations
    scheduling = {"nodeSelector": overlay.node_selector, "tolerations": overlay.tolerations,
                  "affinity": overlay.affinity,
                  "topologySpreadConstraints": overlay.topology_spread,
                  "priorityClassName": overlay.priority_class_name,
                  "imagePullSecrets": [{"name": name} for name in pull_secrets]}
    pod.update({key: value for key, value in scheduling.items() if value})
    return {**template, "metadata": metadata, "spec": pod}


assert {name for name, _ in KEYS.values()} == {f.name for f in fields(PodOverlay)}
