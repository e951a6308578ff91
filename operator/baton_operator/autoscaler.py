"""Autoscaling on a cluster: scrape the pods, run the planner (baton.planner), set the pools.

    list pods -> scrape their /metrics -> planner.observe -> planner.decide(pool sizes)
              -> scale the BatonPools -> Events and status.autoscaling

The planner is pure decision code; this module is what touches Kubernetes. It writes a
pool's replicas through the pool's scale subresource, as ``kubectl scale`` or an HPA would,
and the ordinary reconcile resizes the Deployment and the chains from there.

Loss-free scale-down: before a decode pod count goes down, the pod the planner names (the
fewest sequences running) gets the lowest ``controller.kubernetes.io/pod-deletion-cost``,
so the ReplicaSet removes that one. Kubernetes sends it SIGTERM; the decode server leaves
routing (no new work), finishes its streams within ``server.grace_s`` and exits, and a
stream still running at the end is moved to another pod by the gateway, which replays the
prompt and the tokens already sent (docs/operations.md, "Autoscaling"). A chain is only
removed when the planner saw it idle; the highest-numbered chain goes.

One planner per service lives in this process. What it has learnt (the model's
measurements, each role's last change and how long it has wanted fewer) is written with
every decision to ``status.autoscaling.plannerState``; an operator that restarts or takes
over the lease restores it from there, so cool-downs and the fitted model survive it. Only
the scrapes are not kept: the new planner holds sizes until it has two of its own.
"""

from __future__ import annotations

import datetime
import logging
import time
from collections.abc import Callable

from baton.planner import Decision, Planner, Replicas
from baton.planner.scraper import Target, scrape

from baton_operator import workloads
from baton_operator.kube import Kube
from baton_operator.spec import ServiceSpec

log = logging.getLogger(__name__)

DELETION_COST = "controller.kubernetes.io/pod-deletion-cost"
DRAIN_FIRST_COST = "-1000"  # below every other pod's (default 0)


TIME_FORMAT = "%Y-%m-%dT%H:%M:%SZ"


def _timestamp(wall_s: float) -> str:
    return datetime.datetime.fromtimestamp(wall_s, datetime.UTC).strftime(TIME_FORMAT)


def _parse_timestamp(text: str) -> float:
    return datetime.datetime.strptime(text, TIME_FORMAT).replace(tzinfo=datetime.UTC).timestamp()


class Autoscaler:
    def __init__(self, kube: Kube, clock: Callable[[], float] = time.monotonic,
                 scraper: Callable = scrape, wall_clock: Callable[[], float] = time.time) -> None:
        self.kube = kube
        self.clock = clock
        self.wall_clock = wall_clock  # status timestamps (the planner's clock is monotonic)
        self.scraper = scraper
        self._planners: dict[tuple[str, str], Planner] = {}
        self._last_scrape_s: dict[tuple[str, str], float] = {}

    def forget(self, namespace: str, name: str) -> None:
        self._planners.pop((namespace, name), None)
        self._last_scrape_s.pop((namespace, name), None)

    def tick(self, service: dict, spec: ServiceSpec) -> Decision | None:
        """One planner step for ``service`` when its interval has passed; None otherwise."""
        meta = service["metadata"]
        key = (meta["namespace"], meta["name"])
        if not spec.autoscaling.enabled:
            self.forget(*key)
            return None
        config = spec.autoscaling.planner
        planner = self._planners.get(key)
        if planner is None or planner.config != config:
            planner = self._planners[key] = self._new_planner(service, spec, planner)
        now = self.clock()
        if now - self._last_scrape_s.get(key, -float("inf")) < config.interval_s:
            return None
        self._last_scrape_s[key] = now
        planner.observe(self.scraper(self._targets(*key, spec), now))
        current = Replicas(self._pool(*key, "prefill"), self._pool(*key, "decode"))
        decision = planner.decide(current)
        self._apply(service, decision)
        self._report(service, decision, planner)
        return decision

    def _new_planner(self, service: dict, spec: ServiceSpec, previous: Planner | None) -> Planner:
        """A planner for new settings keeps what the previous one learnt; the first one of
        this process takes it from the service's status (written by whoever ran before)."""
        planner = Planner(spec.autoscaling.planner, spec.gateway.routing.prefill_threshold_tokens,
                          self.clock)
        if previous is not None:
            planner.restore(previous.snapshot(), 0.0)
            return planner
        saved = ((service.get("status") or {}).get("autoscaling") or {}).get("plannerState")
        if saved:
            meta = service["metadata"]
            try:
                elapsed_s = max(0.0, self.wall_clock() - _parse_timestamp(saved["savedAt"]))
                planner.restore(saved["snapshot"], elapsed_s)
                log.info("%s/%s: planner state restored from %s", meta["namespace"],
                         meta["name"], saved["savedAt"])
            except (KeyError, TypeError, ValueError) as e:
                log.warning("%s/%s: status.autoscaling.plannerState not used, learning afresh: "
                            "%s", meta["namespace"], meta["name"], e)
        return planner

    # --- reading ---------------------------------------------------------------------------

    def _targets(self, namespace: str, name: str, spec: ServiceSpec) -> list[Target]:
        targets = []
        for role in ("gateway", "prefill", "decode"):
            selector = ",".join(f"{k}={v}" for k, v in workloads.selector(name, role).items())
            for pod in self.kube.list("Pod", namespace, selector):
                address = (pod.get("status") or {}).get("podIP")
                port = _metrics_port(pod)
                if not address or not port or pod["metadata"].get("deletionTimestamp"):
                    continue
                host = f"[{address}]" if ":" in address else address
                targets.append(Target(pod["metadata"]["name"], role,
                                      f"http://{host}:{port}/metrics",
                                      chain=pod["metadata"].get("labels", {}).get(
                                          "baton.dev/chain", "")))
        return targets

    def _pool(self, namespace: str, name: str, role: str) -> int:
        pool = self.kube.get("BatonPool", namespace, f"{name}-{role}") or {}
        return int((pool.get("spec") or {}).get("replicas") or 0)

    # --- writing ---------------------------------------------------------------------------

    def _apply(self, service: dict, decision: Decision) -> None:
        namespace, name = service["metadata"]["namespace"], service["metadata"]["name"]
        if decision.drain_decode_pod:
            self.kube.patch("Pod", namespace, decision.drain_decode_pod, {
                "metadata": {"annotations": {DELETION_COST: DRAIN_FIRST_COST}}})
        for role_decision in decision.roles():
            if role_decision.changed:
                self.kube.patch("BatonPool", namespace, f"{name}-{role_decision.role}",
                                {"spec": {"replicas": role_decision.target}}, "scale")

    def _report(self, service: dict, decision: Decision, planner: Planner) -> None:
        meta, now = service["metadata"], _timestamp(self.wall_clock())
        for role in decision.roles():
            if role.changed:
                verb = "ScaledUp" if role.target > role.current else "ScaledDown"
                what = "decode pods" if role.role == "decode" else "prefill chains"
                drain = (f"; draining {decision.drain_decode_pod} first" if role.role == "decode"
                         and decision.drain_decode_pod else "")
                self._event(service, verb, f"{what} {role.current} -> {role.target}{drain}: "
                                           f"{role.reason}")
        status = {"autoscaling": {
            "lastDecisionTime": now,
            **{role.role: {"current": role.current, "target": role.target,
                           "reason": role.reason[:1024]} for role in decision.roles()},
            "model": planner.model.describe(),
            "plannerState": {"savedAt": now, "snapshot": planner.snapshot()}}}
        if decision.changed:
            status["autoscaling"]["lastScaleTime"] = now
        self.kube.patch("BatonService", meta["namespace"], meta["name"], {"status": status},
                        "status")

    def _event(self, service: dict, reason: str, message: str) -> None:
        self.kube.post_event(service, reason, message, _timestamp(self.wall_clock()))
        meta = service["metadata"]
        log.info("%s/%s %s: %s", meta["namespace"], meta["name"], reason, message)


def _metrics_port(pod: dict) -> int:
    for container in (pod.get("spec") or {}).get("containers") or []:
        for port in container.get("ports") or []:
            if port.get("name") == "metrics":
                return int(port["containerPort"])
    return 0
