"""A Kubernetes API emulator (kmock, by kopf's author) on a local port, for operator tests.

kmock keeps objects in memory and serves them over real HTTP, so the operator
talks to it through the same `kubernetes` client configuration it uses in a
cluster. It has no controllers and no garbage collector: Deployments never
become ready by themselves, and a test plays the controller when it needs to.
"""

from __future__ import annotations

import asyncio
import threading
import uuid

import kmock
import kubernetes
from baton_operator.kube import Kube

RESOURCES = {
    "baton.dev/v1alpha1/batonservices": ("BatonService", {"status"}),
    "baton.dev/v1alpha1/batonpools": ("BatonPool", {"status", "scale"}),
    "apps/v1/deployments": ("Deployment", {"status", "scale"}),
    "apps/v1/statefulsets": ("StatefulSet", {"status", "scale"}),
    "v1/services": ("Service", {"status"}),
    "v1/configmaps": ("ConfigMap", set()),
    "v1/pods": ("Pod", {"status"}),
    "v1/events": ("Event", set()),
    "coordination.k8s.io/v1/leases": ("Lease", set()),
}
# Cluster-scoped kinds every API server has; kopf waits to discover them at startup.
CLUSTER_RESOURCES = {
    "v1/namespaces": "Namespace",
    "apiextensions.k8s.io/v1/customresourcedefinitions": "CustomResourceDefinition",
}
VERBS = {"get", "list", "watch", "create", "update", "patch", "delete"}


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
        emulator = kmock.KubernetesEmulator()
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
