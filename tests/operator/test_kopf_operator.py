"""The real kopf operator loop against kmock's emulator: create, scale, delete end to end."""

from __future__ import annotations

import asyncio
import threading
import time

import kopf
import pytest
from baton_operator.handlers import register
from baton_operator.reconcile import Reconciler
from emulated_cluster import create_service

NS = "serving"


def eventually(check, timeout_s: float = 20.0):
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            result = check()
            if result:
                return result
        except (KeyError, TypeError):
            pass  # not there yet
        if time.monotonic() > deadline:
            raise AssertionError(f"{check.__doc__ or check} did not hold in {timeout_s}s")
        time.sleep(0.1)


@pytest.fixture
def operator(cluster):
    registry = kopf.OperatorRegistry()
    register(registry, Reconciler(cluster.kube, "registry.local/baton:test"))

    @kopf.on.login(registry=registry)
    def login(**_):
        return kopf.ConnectionInfo(server=cluster.url, insecure=True)

    stop, ready = threading.Event(), threading.Event()
    thread = threading.Thread(target=lambda: asyncio.run(kopf.operator(
        registry=registry, standalone=True, namespaces=[NS], stop_flag=stop,
        ready_flag=ready)), daemon=True)
    thread.start()
    assert ready.wait(30), "the operator did not start"
    yield cluster
    stop.set()
    thread.join(timeout=30)


def test_operator_creates_scales_and_deletes(operator):
    kube = operator.kube
    create_service(kube, "demo", {"prefill": {"chains": 1, "ranksPerChain": 2},
                                  "decode": {"replicas": 1}, "mtls": {"insecure": True}})

    def decode_replicas():
        return kube.get("Deployment", NS, "demo-decode")["spec"]["replicas"]

    assert eventually(lambda: decode_replicas() == 1)
    assert eventually(lambda: kube.get("StatefulSet", NS, "demo-prefill-0"))
    assert eventually(lambda: kube.get("BatonService", NS, "demo")["status"]["conditions"])

    kube.patch("BatonPool", NS, "demo-decode", {"spec": {"replicas": 3}}, "scale")
    kube.patch("BatonPool", NS, "demo-prefill", {"spec": {"replicas": 2}}, "scale")
    assert eventually(lambda: decode_replicas() == 3)
    assert eventually(lambda: kube.get("StatefulSet", NS, "demo-prefill-1"))

    kube.delete("BatonService", NS, "demo")
    assert eventually(lambda: kube.get("BatonService", NS, "demo") is None)
    for kind, name in (("Deployment", "demo-decode"), ("StatefulSet", "demo-prefill-1"),
                       ("Service", "demo-gateway"), ("BatonPool", "demo-decode")):
        assert kube.get(kind, NS, name) is None, f"{kind}/{name} outlived its service"


def test_operator_reports_an_invalid_spec_as_degraded(operator):
    kube = operator.kube
    create_service(kube, "broken", {"compression": {"keepRatio": 2.0}})

    def degraded():
        conditions = kube.get("BatonService", NS, "broken")["status"]["conditions"]
        return next(c for c in conditions if c["type"] == "Degraded")

    condition = eventually(degraded)
    assert condition["status"] == "True" and "keep_ratio" in condition["message"]
    assert kube.get("Deployment", NS, "broken-decode") is None
