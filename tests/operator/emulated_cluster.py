"""A Kubernetes API emulator (kmock, by kopf's author) on a local port, for operator tests.

kmock keeps objects in memory and serves them over real HTTP, so the operator
talks to it through the same `kubernetes` client configuration it uses in a
cluster. It has no controllers and no garbage collector: Deployments never
become ready by themselves, and a test plays the controller when it needs to.
It merges every PATCH; a server-side apply is served as the API server serves it
(``server_side_apply``).
"""

from __future__ import annotations

import asyncio
import datetime
import threading
import uuid

import kmock
import kubernetes
import server_side_apply
from baton_operator.kube import APPLY_PATCH, Kube

RESOURCES = {
    "baton.dev/v1alpha1/batonservices": ("BatonService", {"status"}),
    "baton.dev/v1alpha1/batonpools": ("BatonPool", {"status", "scale"}),
    "apps/v1/deployments": ("Deployment", {"status", "scale"}),
    "apps/v1/statefulsets": ("StatefulSet", {"status", "scale"}),
    "v1/services": ("Service", {"status"}),
    "v1/configmaps": ("ConfigMap", set()),
    "v1/pods": ("Pod", {"status"}),
    "v1/events": ("Event", set()),
    "policy/v1/poddisruptionbudgets": ("PodDisruptionBudget", {"status"}),
    "coordination.k8s.io/v1/leases": ("Lease", set()),
}
# Cluster-scoped kinds every API server has; kopf waits to discover them at startup.
CLUSTER_RESOURCES = {
    "v1/namespaces": "Namespace",
    "apiextensions.k8s.io/v1/customresourcedefinitions": "CustomResourceDefinition",
}
VERBS = {"get", "list", "watch", "create", "update", "patch", "delete"}


class _Emulator(kmock.KubernetesEmulator):
    """kmock's emulator, with server-side apply (a PATCH of ``APPLY_PATCH``): the object
    the apply makes, created or reached by a merge patch of kmock's own."""

    async def _handle(self, request):
        if (request.method == kmock.method.PATCH and not request.subresource
                and request.headers.get("Content-Type", "").startswith(APPLY_PATCH)):
            key = (request.resource, request.namespace, request.name)
            async with self._lock:
                # kmock's ObjectsArray has no .get
                stored = self._objects[key] if key in self._objects else None  # noqa: SIM401
                live = None if stored is None or stored.deleted else stored.raw
            now = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
            applied = server_side_apply.apply(live, request.data,
                                              request.params["fieldManager"], now)
            # kmock matches its reactions to the requests it recorded, by identity: the
            # request itself is turned into the create or the merge patch.
            if live is None:
                changes = {"method": kmock.method.POST, "action": kmock.action.CREATE,
                           "data": applied}
            else:
                changes = {"data": server_side_apply.merge_patch(live, applied)}
            for name, value in changes.items():
                object.__setattr__(request, name, value)
        return await super()._handle(request)


class EmulatedCluster:
    """kmock's emulator served from its own event loop in a background thread."""

    def __init__(self):
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.emulator, self.server = self._call(self._start())
        self.url = str(self.server.url).rstrip("/")
        config = kubernetes.client.Configuration(host=self.url)
        self.api_client = kubernetes.client.ApiClient(config)
        self.kube = Kube(self.api_client)

    def _call(self, coroutine):
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop).result(timeout=30)

    async def _start(self):
        emulator = _Emulator()
        for key, (kind, subresources) in RESOURCES.items():
            emulator.resources[key] = kmock.ResourceInfo(
                kind=kind, namespaced=True, verbs=VERBS, subresources=subresources)
        for key, kind in CLUSTER_RESOURCES.items():
            emulator.resources[key] = kmock.ResourceInfo(kind=kind, namespaced=False, verbs=VERBS)
        await emulator.__aenter__()
        server = kmock.Server(emulator)
        await server.__aenter__()
        return emulator, server

    async def _stop(self):
        await self.server.__aexit__(None, None, None)
        await self.emulator.__aexit__(None, None, None)

    def close(self):
        self.api_client.close()
        self._call(self._stop())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=10)

    def writes(self) -> int:
        """How many object-changing requests the emulator has served so far."""
        return sum(len(self.emulator[method]) for method in ("post", "put", "patch", "delete"))


def create_service(kube: Kube, name: str, spec: dict, namespace: str = "serving") -> dict:
    """A BatonService as the API server would store it (uid, generation, resourceVersion set;
    kopf's finalizer patch tests the resourceVersion, which the emulator does not invent)."""
    return kube.create({
        "apiVersion": "baton.dev/v1alpha1", "kind": "BatonService",
        "metadata": {"name": name, "namespace": namespace, "uid": str(uuid.uuid4()),
                     "generation": 1, "resourceVersion": "1"},
        "spec": spec})
