"""Reconcile one `BatonService` from the cluster's current state.

    read spec -> size the pools -> build desired children -> apply / prune
              -> read children's readiness -> write status (conditions + ready counts)

Beside Ready, Progressing and Degraded the service's status says whether its chains and decode
pods will ship and take the same KV (``KVContractMismatch``, ``baton_operator.kv_contract``):
a pair that does not fit is never routed together, so its chains would stand idle.

Every step reads what is there now and writes only what differs, so running it
twice in a row writes nothing the second time, and it can run on every event,
on a timer, or after an operator restart without remembering anything.

The pools (`BatonPool`, one per role) carry the scale subresource, so that
`kubectl scale` and a HorizontalPodAutoscaler can resize prefill chains and
decode workers. The service's own `prefill.chains` / `decode.replicas` seed a
pool when it is created, and win again only when the service's value itself
changes (remembered in the pool's `baton.dev/service-replicas` annotation):
the last writer wins, whoever it was.
"""

from __future__ import annotations

import datetime
import hashlib
import json
from dataclasses import dataclass

from baton_operator import kv_contract, workloads
from baton_operator.kube import Kube
from baton_operator.spec import InvalidSpec, ServiceSpec, read_spec

GROUP_VERSION = "baton.dev/v1alpha1"
CHILD_KINDS = ("ConfigMap", "Service", "Deployment", "StatefulSet", "PodDisruptionBudget")
FIELD_MANAGER = "baton-operator"  # the children's fields the operator owns (server-side apply)
APPLIED_DIGEST = "baton.dev/applied-sha256"
SERVICE_REPLICAS = "baton.dev/service-replicas"


@dataclass(frozen=True)
class RoleCounts:
    desired: int
    ready: int

    def to_status(self) -> dict:
        return {"replicas": self.desired, "readyReplicas": self.ready,
                "ready": f"{self.ready}/{self.desired}"}


def _contains(actual, wanted) -> bool:
    """Whether the live object already holds every value we set (the server adds defaults)."""
    if isinstance(wanted, dict):
        return isinstance(actual, dict) and all(
            key in actual and _contains(actual[key], value) for key, value in wanted.items())
    if isinstance(wanted, list):
        return (isinstance(actual, list) and len(actual) == len(wanted)
                and all(map(_contains, actual, wanted)))
    # The server writes quantities back as strings ("cpu: 2" -> "2").
    return actual == wanted or (isinstance(wanted, (int, float)) and not isinstance(wanted, bool)
                                and str(wanted) == actual)


def _digest(obj: dict) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True).encode()).hexdigest()[:32]


def owner_reference(service: dict) -> dict:
    meta = service["metadata"]
    return {"apiVersion": GROUP_VERSION, "kind": "BatonService", "name": meta["name"],
            "uid": meta["uid"], "controller": True, "blockOwnerDeletion": True}


def _now() -> str:
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def conditions(previous: list[dict], generation: int, **wanted: tuple[bool, str, str]) -> list:
    """Conditions with observedGeneration; a condition keeps its transition time until it flips."""
    old = {c["type"]: c for c in previous or []}
    result = []
    for kind, (status, reason, message) in wanted.items():
        text = "True" if status else "False"
        same = kind in old and old[kind].get("status") == text
        result.append({"type": kind, "status": text, "reason": reason, "message": message,
                       "observedGeneration": generation,
                       "lastTransitionTime": old[kind]["lastTransitionTime"] if same else _now()})
    return result


class Reconciler:
    def __init__(self, kube: Kube, default_image: str):
        self.kube = kube
        self.default_image = default_image

    # ---- the whole pass -------------------------------------------------------------------

    def reconcile(self, service: dict) -> dict:
        """Bring the children in line with ``service``; returns the status it wrote."""
        meta = service["metadata"]
        name, namespace = meta["name"], meta["namespace"]
        spec = read_spec(service.get("spec") or {}, self.default_image)
        num_chains = self._size_pool(service, "prefill", spec.prefill.chains)
        num_decode = self._size_pool(service, "decode", spec.decode.replicas)
        desired = workloads.children(name, namespace, spec, num_chains, num_decode)
        for obj in desired:
            obj["metadata"]["ownerReferences"] = [owner_reference(service)]
            self.apply(obj)
        self.prune(name, namespace, {(o["kind"], o["metadata"]["name"]) for o in desired})
        return self._write_status(service, spec, num_chains)

    def record_invalid(self, service: dict, error: InvalidSpec) -> None:
        """An unbuildable spec: say why in a Degraded condition, and once in a Warning Event
        (what `kubectl describe` shows), and touch no child."""
        status = service.get("status") or {}
        generation = service["metadata"].get("generation", 1)
        said = {c["type"]: c for c in status.get("conditions") or []}.get("Degraded") or {}
        if said.get("message") != str(error):
            self.kube.post_event(service, "InvalidSpec", str(error), _now(), "Warning")
        new = {"observedGeneration": generation, "conditions": conditions(
            status.get("conditions"), generation,
            Ready=(False, "InvalidSpec", str(error)),
            Progressing=(False, "InvalidSpec", "waiting for a valid spec"),
            Degraded=(True, "InvalidSpec", str(error)))}
        self._patch_status("BatonService", service, new)

    def delete(self, name: str, namespace: str) -> int:
        """Remove every child, gateway first so no new request lands on a dying worker.

        Owner references let the garbage collector do this too, but only after the
        service is gone and in no order; pools are children as well.
        """
        removed = 0
        for role in ("gateway", "prefill", "decode", "redis"):
            for kind in ("Deployment", "StatefulSet", "Service", "ConfigMap",
                         "PodDisruptionBudget"):
                for obj in self.kube.list(kind, namespace, _selector(name, role)):
                    removed += self.kube.delete(kind, namespace, obj["metadata"]["name"])
        for role in ("prefill", "decode"):
            removed += self.kube.delete("BatonPool", namespace, f"{name}-{role}")
        return removed

    # ---- children -------------------------------------------------------------------------

    def apply(self, obj: dict) -> str:
        """Server-side apply ``obj`` unless the live object holds it already; 'created',
        'updated' or 'unchanged'. What other controllers and people set on a child (an
        annotation of `kubectl rollout restart`, a label, a webhook's field) is theirs
        and stays; what the operator set before and ``obj`` lacks now is removed.

        The digest of what was applied last rides on the object: an ``obj`` that merely
        dropped a field is contained in the live object, yet must be applied."""
        meta = obj["metadata"]
        digest = _digest(obj)
        meta["annotations"] = {**meta.get("annotations", {}), APPLIED_DIGEST: digest}
        live = self.kube.get(obj["kind"], meta["namespace"], meta["name"])
        if live is not None and _contains(live, obj):
            return "unchanged"  # same digest (an annotation obj holds) and every value set
        self.kube.apply(obj, FIELD_MANAGER)
        return "created" if live is None else "updated"

    def prune(self, name: str, namespace: str, keep: set[tuple[str, str]]) -> list[str]:
        """Delete children no longer wanted (a chain scaled away, Redis gone external)."""
        removed = []
        for kind in CHILD_KINDS:
            for obj in self.kube.list(kind, namespace, f"baton.dev/service={name}"):
                if (kind, obj["metadata"]["name"]) not in keep:
                    self.kube.delete(kind, namespace, obj["metadata"]["name"])
                    removed.append(f"{kind}/{obj['metadata']['name']}")
        return removed

    # ---- pools ----------------------------------------------------------------------------

    def _size_pool(self, service: dict, role: str, service_replicas: int) -> int:
        """The pool's replica count, creating the pool or taking the service's new value."""
        name, namespace = service["metadata"]["name"], service["metadata"]["namespace"]
        pool_name = f"{name}-{role}"
        pool = self.kube.get("BatonPool", namespace, pool_name)
        seed = {SERVICE_REPLICAS: str(service_replicas)}
        if pool is None:
            self.kube.create({
                "apiVersion": GROUP_VERSION, "kind": "BatonPool",
                "metadata": {"name": pool_name, "namespace": namespace, "annotations": seed,
                             "labels": workloads.labels(name, role),
                             "ownerReferences": [owner_reference(service)]},
                "spec": {"service": name, "role": role, "replicas": service_replicas}})
            return service_replicas
        annotations = pool["metadata"].get("annotations") or {}
        if annotations.get(SERVICE_REPLICAS) != str(service_replicas):
            self.kube.patch("BatonPool", namespace, pool_name, {
                "metadata": {"annotations": seed}, "spec": {"replicas": service_replicas}})
            return service_replicas
        return int(pool["spec"].get("replicas", service_replicas))

    # ---- status ---------------------------------------------------------------------------

    def _ready(self, kind: str, namespace: str, name: str) -> int:
        live = self.kube.get(kind, namespace, name) or {}
        return int((live.get("status") or {}).get("readyReplicas") or 0)

    def _write_status(self, service: dict, spec: ServiceSpec, num_chains: int) -> dict:
        name, namespace = service["metadata"]["name"], service["metadata"]["namespace"]
        ranks = spec.prefill.chain.ranks
        ready_chains = sum(
            self._ready("StatefulSet", namespace, workloads.chain_name(name, i)) >= ranks
            for i in range(num_chains))
        decode_name = f"{name}-decode"
        counts = {
            "prefill": RoleCounts(num_chains, ready_chains),
            "decode": RoleCounts(self._pool_replicas(namespace, decode_name),
                                 self._ready("Deployment", namespace, decode_name)),
            "gateway": RoleCounts(spec.gateway.replicas,
                                  self._ready("Deployment", namespace, f"{name}-gateway")),
        }
        for role in ("prefill", "decode"):
            self._write_pool_status(name, namespace, role, counts[role])
        ready = all(c.ready >= c.desired for c in counts.values())
        waiting = ", ".join(f"{role} {c.ready}/{c.desired}" for role, c in counts.items()
                            if c.ready < c.desired)
        generation = service["metadata"].get("generation", 1)
        old = service.get("status") or {}
        mismatched = kv_contract.mismatches(name, namespace, spec)
        status = {
            "observedGeneration": generation,
            "endpoint": f"{name}-gateway.{namespace}.svc:{workloads.GATEWAY_PORT}",
            **{role: c.to_status() for role, c in counts.items()},
            "conditions": conditions(
                old.get("conditions"), generation,
                Ready=(ready, "AllReady" if ready else "Waiting",
                       "every role is ready" if ready else f"waiting for {waiting}"),
                Progressing=(not ready, "Rollout" if not ready else "Stable",
                             f"waiting for {waiting}" if not ready else "nothing to roll out"),
                Degraded=(False, "SpecValid", "the spec is valid"),
                KVContractMismatch=(
                    bool(mismatched), "Mismatch" if mismatched else "Consistent",
                    f"prefill ships KV decode does not take ({'; '.join(mismatched)}): the "
                    f"gateways route no request to a chain" if mismatched else
                    "prefill and decode settings agree on the KV they ship and take")),
        }
        self._patch_status("BatonService", service, status)
        return status

    def _pool_replicas(self, namespace: str, pool_name: str) -> int:
        pool = self.kube.get("BatonPool", namespace, pool_name) or {}
        return int((pool.get("spec") or {}).get("replicas") or 0)

    def _write_pool_status(self, name: str, namespace: str, role: str, counts: RoleCounts) -> None:
        """The pool's counts (the scale subresource reads replicas and selector), and a Ready
        condition, both for the pool's generation the operator has acted on."""
        pool = self.kube.get("BatonPool", namespace, f"{name}-{role}")
        if pool is None:
            return
        generation = pool["metadata"].get("generation", 1)
        ready = counts.ready >= counts.desired
        unit = "chains" if role == "prefill" else "pods"
        message = f"{counts.ready} of {counts.desired} {unit} ready"
        self._patch_status("BatonPool", pool, {
            "observedGeneration": generation,
            "replicas": counts.desired, "readyReplicas": counts.ready,
            "selector": _selector(name, role),
            "conditions": conditions((pool.get("status") or {}).get("conditions"), generation,
                                     Ready=(ready, "AllReady" if ready else "Waiting", message))})

    def _patch_status(self, kind: str, obj: dict, status: dict) -> None:
        if _contains(obj.get("status") or {}, status):
            return  # unchanged: no write, so an idempotent pass stays silent
        meta = obj["metadata"]
        self.kube.patch(kind, meta["namespace"], meta["name"], {"status": status}, "status")


def _selector(name: str, role: str) -> str:
    return ",".join(f"{k}={v}" for k, v in workloads.selector(name, role).items())
