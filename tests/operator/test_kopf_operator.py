"""The real kopf operator loop against kmock's emulator: create, scale, delete end to end, and
the autoscaler's timer sizing a service from its pods' live metrics."""

from __future__ import annotations

import asyncio
import threading
import time

import kopf
import pytest
from baton.metrics import DecodeMetrics, GatewayMetrics
from baton_operator.autoscaler import Autoscaler
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
    # As the operator's main registers them, with the autoscaler's timer made quick.
    register(registry, Reconciler(cluster.kube, "registry.local/baton:test"),
             Autoscaler(cluster.kube), autoscale_tick_s=0.2)

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


def test_the_autoscale_timer_raises_the_decode_pool_when_itl_is_missed(operator, pods):
    kube = operator.kube
    create_service(kube, "demo", {
        "prefill": {"chains": 1, "ranksPerChain": 2}, "decode": {"replicas": 1},
        "mtls": {"insecure": True},
        "autoscaling": {"enabled": True, "itlP90Seconds": 0.2, "intervalSeconds": 1,
                        "scaleUpCooldownSeconds": 0, "decode": {"maxReplicas": 3},
                        "prefill": {"minChains": 1}}})
    gateway: GatewayMetrics = pods.add("demo-gateway-x", "gateway", GatewayMetrics)
    decode: DecodeMetrics = pods.add("demo-decode-a", "decode", DecodeMetrics)
    decode.kv_blocks_total.set(1000)
    decode.running_sequences.set(8)
    streaming = threading.Event()

    def stream_slowly():  # tokens 0.5 s apart in every scrape interval: ITL P90 missed
        while not streaming.wait(0.05):
            gateway.record_lengths(100, 50)
            gateway.time_between_tokens_s.observe(0.5)

    feeder = threading.Thread(target=stream_slowly, daemon=True)
    feeder.start()
    try:
        # the planner decides on a window of scrapes a second apart, after the operator has
        # reconciled the service (about 16 s on an idle 2-core host: time to spare)
        assert eventually(lambda: kube.get("BatonPool", NS, "demo-decode")["spec"]["replicas"] >= 2,
                          timeout_s=60.0)
    finally:
        streaming.set()
        feeder.join(timeout=5)
    # The timer's decision led to a reconcile: the Deployment follows the pool.
    assert eventually(lambda: kube.get("Deployment", NS, "demo-decode")["spec"]["replicas"] >= 2,
                      timeout_s=60.0)
    status = kube.get("BatonService", NS, "demo")["status"]["autoscaling"]
    assert status["decode"]["target"] >= 2 and status["plannerState"]["snapshot"]
    assert any(e["reason"] == "ScaledUp" and "decode pods 1 -> 2" in e["message"]
               and "ITL P90" in e["message"] for e in kube.list("Event", NS, ""))
    assert kube.get("BatonPool", NS, "demo-prefill")["spec"]["replicas"] == 1


def test_a_bad_model_uri_is_reported_in_the_status_and_an_event(operator):
    kube = operator.kube
    create_service(kube, "badmodel", {"model": {"uri": "s3://bucket/llama"},
                                      "mtls": {"insecure": True}})

    def degraded():
        conditions = kube.get("BatonService", NS, "badmodel")["status"]["conditions"]
        return next(c for c in conditions if c["type"] == "Degraded")

    assert "spec.model.uri 's3://bucket/llama'" in eventually(degraded)["message"]

    def event():
        return next((e for e in kube.list("Event", NS, "")
                    if "spec.model.uri" in e["message"]
                    and e["involvedObject"]["name"] == "badmodel"), None)

    assert eventually(event)["type"] == "Warning"
    assert kube.get("Deployment", NS, "badmodel-decode") is None
