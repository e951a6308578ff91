"""Autoscaling on one machine (``baton up --autoscale``): the operator's planner, applied to
the local cluster's decode pods.

    every interval_s: scrape the pods' /metrics -> planner.observe -> planner.decide
                      -> start or retire decode pods -> write the planner's metrics

The same pure planner as on a cluster (``baton.planner``) reads the same series, scraped
from each local process's metrics port (``LocalCluster.metrics_targets``). Scale-up starts
decode pods (they join routing once they register); scale-down retires one at a time the
pod the planner names (the fewest sequences running): ``LocalCluster.retire_decode_worker``
sends it SIGTERM as Kubernetes would, so it leaves routing, finishes its streams within
its grace and exits, and the gateway moves a stream it did not finish to another pod by
replaying the prompt and the tokens sent (docs/operations.md, "Autoscaling").

Prefill chains are not changed here: ``baton up`` runs one chain (or none). The planner
still sizes them, and its prefill target is shown beside the decode one.

After each decision the planner's target and the live count per role are written to
``LocalCluster.planner_textfile`` (Prometheus text, replaced atomically), which the
gateway's HTTP ``/metrics`` adds to its own: ``baton_planner_target_replicas{role}`` and
``baton_replicas{role}``.

With ``trace_path`` (``baton up --planner-trace``) every step is also recorded
(``baton.planner.trace``): the planner's tests replay such a recording.

Nothing here sleeps: ``tick()`` is called by ``baton up``'s supervision loop and acts when
``interval_s`` has passed on the injected clock.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from pathlib import Path

from prometheus_client import CollectorRegistry, write_to_textfile

from baton.local.cluster import LocalCluster
from baton.metrics import PlannerMetrics
from baton.planner import Decision, Planner, Replicas
from baton.planner.scraper import scrape
from baton.planner.trace import TraceWriter

log = logging.getLogger(__name__)


class LocalAutoscaler:
    def __init__(self, cluster: LocalCluster, clock: Callable[[], float] = time.monotonic,
                 scraper: Callable = scrape, trace_path: Path | None = None) -> None:
        if cluster.spec.autoscale is None:
            raise ValueError("the cluster is not autoscaled: its spec has no planner settings "
                             "(ClusterSpec.autoscale)")
        self.cluster = cluster
        self.config = cluster.spec.autoscale
        self.clock = clock
        self.scraper = scraper
        self.planner = Planner(self.config, cluster.spec.prefill_threshold_tokens, clock)
        self.metrics = PlannerMetrics(CollectorRegistry())
        self.last_decision: Decision | None = None
        self._next_tick_s = clock()
        self._prefill_reported = cluster.num_chains  # the prefill target last told (not applied)
        self.trace = (TraceWriter(trace_path, self.config, cluster.spec.prefill_threshold_tokens)
                      if trace_path is not None else None)

    def close(self) -> None:
        if self.trace is not None:
            self.trace.close()

    def seconds_to_next_tick(self) -> float:
        return max(0.0, self._next_tick_s - self.clock())

    def tick(self) -> list[str]:
        """One planner step when its interval has passed: one line per change made."""
        now = self.clock()
        if now < self._next_tick_s:
            return []
        self._next_tick_s = now + self.config.interval_s
        reading = self.scraper(self.cluster.metrics_targets(), now)
        self.planner.observe(reading)
        current = self._replicas()
        decision = self.planner.decide(current)
        if self.trace is not None:
            self.trace.write(reading, current, decision)
        self.last_decision = decision
        events = self._apply(decision)
        self._publish(decision)
        return events

    def _replicas(self) -> Replicas:
        return Replicas(self.cluster.num_chains, len(self.cluster.decode_pods()))

    def _apply(self, decision: Decision) -> list[str]:
        decode, events = decision.decode, []
        if decode.target > decode.current:
            started = [self.cluster.add_decode_worker().name
                       for _ in range(decode.target - decode.current)]
            events.append(f"decode pods {decode.current} -> {decode.target} (starting "
                          f"{', '.join(started)}): {decode.reason}")
        elif decode.target < decode.current:
            name = self._pod_to_retire(decision.drain_decode_pod)
            self.cluster.retire_decode_worker(name)
            events.append(f"decode pods {decode.current} -> {decode.target} (draining {name}): "
                          f"{decode.reason}")
        if decision.prefill.changed and decision.prefill.target != self._prefill_reported:
            self._prefill_reported = decision.prefill.target
            events.append(f"prefill chains: the planner would have {decision.prefill.target} "
                          f"(baton up keeps its {decision.prefill.current}): "
                          f"{decision.prefill.reason}")
        for event in events:
            log.info("autoscaler: %s", event)
        return events

    def _pod_to_retire(self, named: str) -> str:
        """The pod the planner named; the newest one when it named none that still runs
        (its metrics were not scraped)."""
        names = [child.name for child in self.cluster.decode_pods()]
        return named if named in names else names[-1]

    def _publish(self, decision: Decision) -> None:
        live = self._replicas()
        for role in decision.roles():
            self.metrics.target_replicas.labels(role=role.role).set(role.target)
            self.metrics.replicas.labels(role=role.role).set(live.of(role.role))
        write_to_textfile(str(self.cluster.planner_textfile), self.metrics.registry)
