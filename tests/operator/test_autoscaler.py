"""The operator's autoscaler against kmock's emulator, reading real /metrics endpoints.

The pods are Pod objects in the emulator whose metrics port points at a real Prometheus
endpoint (baton.metrics.serve_metrics) on this machine; the test plays the pods (it sets
their metrics) and the clock. Targets missed -> the right pool grows; load gone -> it
shrinks only after the cool-down, emptiest decode pod first; status and Events written.
"""

from __future__ import annotations

import logging

import pytest
from baton.metrics import DecodeMetrics, GatewayMetrics
from baton_operator.autoscaler import DELETION_COST, Autoscaler
from baton_operator.reconcile import Reconciler
from baton_operator.spec import read_spec
from emulated_cluster import create_service

NS = "serving"
AUTOSCALING = {"enabled": True, "itlP90Seconds": 0.2, "ttftP90Seconds": 2.0,
               "decode": {"minReplicas": 1, "maxReplicas": 4},
               "prefill": {"minChains": 1, "maxChains": 2},
               "intervalSeconds": 10, "scaleUpCooldownSeconds": 10,
               "scaleDownCooldownSeconds": 60}
SPEC = {"prefill": {"chains": 1, "ranksPerChain": 2}, "decode": {"replicas": 1},
        "mtls": {"insecure": True}, "autoscaling": AUTOSCALING}


def _events(cluster) -> list[dict]:
    return cluster.kube.list("Event", NS, "")


def test_missed_itl_raises_decode_then_idle_lowers_it_after_the_cool_down(cluster, pods):
    kube = cluster.kube
    create_service(kube, "demo", SPEC)
    Reconciler(kube, "registry.local/baton:test").reconcile(kube.get("BatonService", NS, "demo"))
    clock = [0.0]
    autoscaler = Autoscaler(kube, clock=lambda: clock[0])
    gateway: GatewayMetrics = pods.add("demo-gateway-x", "gateway", GatewayMetrics)
    first: DecodeMetrics = pods.add("demo-decode-a", "decode", DecodeMetrics)
    first.kv_blocks_total.set(1000)

    def tick():
        service = kube.get("BatonService", NS, "demo")
        decision = autoscaler.tick(service, read_spec(service["spec"], "img"))
        clock[0] += 10
        return decision

    def pool(role: str) -> int:
        return kube.get("BatonPool", NS, f"demo-{role}")["spec"]["replicas"]

    assert tick() is not None  # the first scrape: nothing to compare yet
    for _ in range(20):  # streams whose tokens come 0.5 s apart: ITL P90 far above 0.2 s
        gateway.record_lengths(100, 50)
        gateway.time_between_tokens_s.observe(0.5)
    first.running_sequences.set(8)
    decision = tick()
    assert decision.decode.target == 2 and "ITL P90" in decision.decode.reason
    assert pool("decode") == 2 and pool("prefill") == 1  # the role that owns ITL grew
    status = kube.get("BatonService", NS, "demo")["status"]["autoscaling"]
    assert status["decode"] == {"current": 1, "target": 2, "reason": decision.decode.reason}
    assert "lastScaleTime" in status and "model" in status
    (event,) = [e for e in _events(cluster) if e["reason"] == "ScaledUp"]
    assert event["involvedObject"]["name"] == "demo" and "decode pods 1 -> 2" in event["message"]

    # The reconcile follows the pool: the Deployment asks for two pods.
    Reconciler(kube, "registry.local/baton:test").reconcile(kube.get("BatonService", NS, "demo"))
    assert kube.get("Deployment", NS, "demo-decode")["spec"]["replicas"] == 2
    second: DecodeMetrics = pods.add("demo-decode-b", "decode", DecodeMetrics)
    second.kv_blocks_total.set(1000)
    second.running_sequences.set(2)
    first.running_sequences.set(0)  # the emptier one: it goes first

    # Load gone (the burst was in the 10..20 s interval): nothing lowers until the planner's
    # window (120 s) no longer holds the burst
    # and the cool-down (60 s) has passed since it first wanted fewer.
    lowered_at = None
    for _ in range(25):
        before = clock[0]
        decision = tick()
        if decision is not None and decision.decode.changed:
            lowered_at = before
            break
    assert lowered_at is not None, decision.decode.reason
    assert lowered_at >= 10 + 120 + 60, f"lowered at {lowered_at}, inside the window or cool-down"
    assert decision.decode.target == 1 and pool("decode") == 1
    drained = kube.get("Pod", NS, "demo-decode-a")["metadata"]["annotations"]
    assert drained[DELETION_COST] == "-1000"  # the ReplicaSet removes this one first
    assert "annotations" not in kube.get("Pod", NS, "demo-decode-b")["metadata"] or \
        DELETION_COST not in kube.get("Pod", NS, "demo-decode-b")["metadata"]["annotations"]
    reasons = [e["reason"] for e in _events(cluster)]
    assert reasons.count("ScaledDown") == 1
    assert pool("prefill") == 1  # min chains: the chain stays


def test_autoscaling_off_touches_nothing(cluster):
    kube = cluster.kube
    create_service(kube, "demo", {**SPEC, "autoscaling": {"enabled": False}})
    Reconciler(kube, "img").reconcile(kube.get("BatonService", NS, "demo"))
    service = kube.get("BatonService", NS, "demo")
    assert Autoscaler(kube, clock=lambda: 0.0).tick(service, read_spec(service["spec"], "i")) is None
    assert "autoscaling" not in (kube.get("BatonService", NS, "demo").get("status") or {})


@pytest.mark.parametrize("bad", [{"decode": {"minReplicas": 3, "maxReplicas": 2}},
                                 {"itlP90Seconds": 0}, {"enabled": "yes"}])
def test_bad_autoscaling_settings_are_an_invalid_spec(bad):
    from baton_operator.spec import InvalidSpec

    with pytest.raises(InvalidSpec, match="autoscaling"):
        read_spec({**SPEC, "autoscaling": {**AUTOSCALING, **bad}}, "img")


@pytest.mark.parametrize("state", ["kept", "corrupted"])
def test_a_restarted_operator_keeps_the_cool_down_and_the_model(cluster, pods, state, caplog):
    """The planner's state rides in status.autoscaling.plannerState: a new operator process
    (a new Autoscaler, its own monotonic clock) does not scale up again inside the cool-down
    the old one started; with that state unreadable it learns afresh and says why."""
    kube = cluster.kube
    create_service(kube, "demo", {**SPEC, "autoscaling": {
        **AUTOSCALING, "scaleUpCooldownSeconds": 60, "decode": {"minReplicas": 1,
                                                                "maxReplicas": 4}}})
    Reconciler(kube, "img").reconcile(kube.get("BatonService", NS, "demo"))
    gateway: GatewayMetrics = pods.add("demo-gateway-x", "gateway", GatewayMetrics)
    decode: DecodeMetrics = pods.add("demo-decode-a", "decode", DecodeMetrics)
    decode.kv_blocks_total.set(1000)
    decode.running_sequences.set(8)
    wall = [1_800_000_000.0]

    def slow_tokens():  # ITL P90 far above the 0.2 s target, every interval
        for _ in range(20):
            gateway.record_lengths(100, 50)
            gateway.time_between_tokens_s.observe(0.5)
            decode.time_between_tokens_s.observe(0.5)

    def tick(autoscaler, clock):
        slow_tokens()
        service = kube.get("BatonService", NS, "demo")
        decision = autoscaler.tick(service, read_spec(service["spec"], "img"))
        clock[0] += 10
        wall[0] += 10
        return decision

    old_clock = [0.0]
    old = Autoscaler(kube, clock=lambda: old_clock[0], wall_clock=lambda: wall[0])
    tick(old, old_clock)
    assert tick(old, old_clock).decode.target == 2
    saved = kube.get("BatonService", NS, "demo")["status"]["autoscaling"]
    assert saved["model"]["decodeItlPoints"] == 1  # the pod's own gaps, one interval's worth
    assert saved["plannerState"]["snapshot"]["roles"]["decode"]["secondsSinceChange"] == 0
    if state == "corrupted":
        kube.patch("BatonService", NS, "demo", {"status": {"autoscaling": {
            "plannerState": {"savedAt": "yesterday", "snapshot": {}}}}}, "status")

    new_clock = [5000.0]  # another process: its monotonic clock has nothing to do with the old
    new = Autoscaler(kube, clock=lambda: new_clock[0], wall_clock=lambda: wall[0])
    with caplog.at_level(logging.WARNING, "baton_operator.autoscaler"):
        assert tick(new, new_clock).decode.reason == "waiting for a second scrape"
    model = kube.get("BatonService", NS, "demo")["status"]["autoscaling"]["model"]
    decision = tick(new, new_clock)  # 20 s after the scale-up, the target still missed
    if state == "corrupted":
        assert "plannerState not used" in caplog.text and "yesterday" in caplog.text
        assert model["decodeItlPoints"] == 0
        assert decision.decode.target == 3, decision.decode.reason
        return
    assert model == saved["model"]  # nothing learnt yet, nothing forgotten
    assert decision.decode.target == 2 and decision.decode.reason.startswith("cool-down (20 of 60"), \
        decision.decode.reason
    targets = [tick(new, new_clock).decode.target for _ in range(4)]  # 30..60 s after it
    assert targets == [2, 2, 2, 3], targets
