"""A small dict-in, dict-out client for the few kinds the operator touches.

The generated typed APIs of the `kubernetes` package turn every object into a
model class and back; the operator builds plain manifests and compares them
with what the API server holds, so it talks JSON on the resource paths
directly, through the `kubernetes` package's configured ApiClient (auth, TLS,
in-cluster config all stay the package's business).
"""

from __future__ import annotations

import json
import uuid
from typing import Any

from kubernetes.client import ApiClient

# kind -> (API prefix, plural); every kind here is namespaced.
RESOURCES: dict[str, tuple[str, str]] = {
    "ConfigMap": ("/api/v1", "configmaps"),
    "Pod": ("/api/v1", "pods"),
    "Event": ("/api/v1", "events"),
    "Service": ("/api/v1", "services"),
    "Deployment": ("/apis/apps/v1", "deployments"),
    "StatefulSet": ("/apis/apps/v1", "statefulsets"),
    "PodDisruptionBudget": ("/apis/policy/v1", "poddisruptionbudgets"),
    "Lease": ("/apis/coordination.k8s.io/v1", "leases"),
    "BatonService": ("/apis/baton.dev/v1alpha1", "batonservices"),
    "BatonPool": ("/apis/baton.dev/v1alpha1", "batonpools"),
}
MERGE_PATCH = "application/merge-patch+json"
APPLY_PATCH = "application/apply-patch+yaml"  # server-side apply (a JSON body is YAML)
COMPONENT = "baton-operator"  # who Events say reported them


class KubeError(RuntimeError):
    def __init__(self, status: int, method: str, path: str, text: str):
        super().__init__(f"{method} {path} -> HTTP {status}: {text[:500]}")
        self.status = status


class Kube:
    def __init__(self, api_client: ApiClient):
        self._client = api_client

    def _path(self, kind: str, namespace: str, name: str = "", subresource: str = "") -> str:
        prefix, plural = RESOURCES[kind]
        path = f"{prefix}/namespaces/{namespace}/{plural}"
        return "/".join(p for p in (path, name, subresource) if p)

    def _request(self, method: str, path: str, body: Any = None, content_type: str = "",
                 query: dict | None = None) -> dict | None:
        """The decoded response, or None for 404."""
        headers = {"Accept": "application/json",
                   "Content-Type": content_type or "application/json"}
        method, url, headers, body, _ = self._client.param_serialize(
            method, path, header_params=headers, body=body, auth_settings=["BearerToken"],
            query_params=list((query or {}).items()))
        response = self._client.call_api(method, url, header_params=headers, body=body)
        text = response.read().decode()
        if response.status == 404:
            return None
        if response.status >= 400:
            raise KubeError(response.status, method, path, text)
        return json.loads(text) if text else {}

    def get(self, kind: str, namespace: str, name: str) -> dict | None:
        return self._request("GET", self._path(kind, namespace, name))

    def list(self, kind: str, namespace: str, label_selector: str) -> list[dict]:
        """Objects matching an equality selector ``k=v,k2=v2`` (empty: every object)."""
        found = self._request("GET", self._path(kind, namespace),
                              query={"labelSelector": label_selector})
        wanted = dict(term.split("=", 1) for term in label_selector.split(",") if term)
        # Filtered again here: deleting by selector must stay safe on an API
        # (or test emulator) that answers a list without applying the selector.
        return [obj for obj in (found or {}).get("items", [])
                if wanted.items() <= (obj["metadata"].get("labels") or {}).items()]

    def create(self, obj: dict) -> dict:
        namespace = obj["metadata"]["namespace"]
        return self._request("POST", self._path(obj["kind"], namespace), body=obj)

    def patch(self, kind: str, namespace: str, name: str, patch: dict,
              subresource: str = "") -> dict | None:
        return self._request("PATCH", self._path(kind, namespace, name, subresource),
                             body=patch, content_type=MERGE_PATCH)

    def apply(self, obj: dict, field_manager: str) -> dict:
        """Server-side apply: ``obj`` is everything ``field_manager`` sets on the object,
        created when missing. Fields other managers set are left alone; a field this
        manager set before and ``obj`` no longer has is removed; one another manager
        changed since is taken back (force)."""
        meta = obj["metadata"]
        return self._request("PATCH", self._path(obj["kind"], meta["namespace"], meta["name"]),
                             body=obj, content_type=APPLY_PATCH,
                             query={"fieldManager": field_manager, "force": "true"})

    def delete(self, kind: str, namespace: str, name: str) -> bool:
        """True when the object existed."""
        return self._request("DELETE", self._path(kind, namespace, name),
                             body={"propagationPolicy": "Background"}) is not None

    def post_event(self, involved: dict, reason: str, message: str, now: str,
                   event_type: str = "Normal") -> dict:
        """A core/v1 Event about ``involved`` (what `kubectl describe` lists); ``now`` is an
        RFC 3339 time."""
        meta = involved["metadata"]
        return self.create({
            "apiVersion": "v1", "kind": "Event",
            "metadata": {"name": f"{meta['name']}.{uuid.uuid4().hex[:16]}",
                         "namespace": meta["namespace"]},
            "involvedObject": {"apiVersion": involved.get("apiVersion", "baton.dev/v1alpha1"),
                               "kind": involved.get("kind", "BatonService"),
                               "name": meta["name"], "namespace": meta["namespace"],
                               "uid": meta.get("uid", "")},
            "reason": reason, "message": message[:1024], "type": event_type,
            "source": {"component": COMPONENT}, "reportingComponent": COMPONENT,
            "firstTimestamp": now, "lastTimestamp": now, "count": 1})
