"""Pods of a service in the emulator whose metrics port is a real Prometheus endpoint
(baton.metrics.serve_metrics) on this machine: the test plays the pods by setting their
metrics, and the autoscaler scrapes them over HTTP as it would in a cluster."""

from __future__ import annotations

from baton.metrics import serve_metrics
from baton.serving import free_port
from baton_operator.workloads import labels
from prometheus_client import CollectorRegistry

NS = "serving"


class Pods:
    """Pods of the service in the emulator, each with a live metrics endpoint."""

    def __init__(self, cluster, service: str = "demo") -> None:
        self.cluster = cluster
        self.service = service
        self.stops = []
        self.metrics = {}

    def add(self, name: str, role: str, kind) -> object:
        registry = CollectorRegistry()
        metrics = kind(registry, "demo")
        port = free_port()
        self.stops.append(serve_metrics("127.0.0.1", port, registry))
        self.cluster.kube.create({
            "apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": name, "namespace": NS, "labels": labels(self.service, role)},
            "spec": {"containers": [{"name": role, "ports": [
                {"name": "metrics", "containerPort": port}]}]},
            "status": {"podIP": "127.0.0.1"}})
        self.metrics[name] = metrics
        return metrics

    def close(self) -> None:
        for stop in self.stops:
            stop()
