"""The local autoscaler's decisions applied to a cluster, without processes: the real planner
reads a simulated service's real metric classes (tests/planner/simulated.py) whose decode
pods are the cluster's; the test's clock is the planner's. Starting and retiring real
processes is tests/e2e/test_autoscale.py."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest
from baton.config import PlannerConfig
from baton.local.autoscaler import LocalAutoscaler
from baton.planner import Replicas, parse_pod
from baton.planner.observation import PLANNER_SERIES
from baton.planner.trace import read_trace, replay
from planner.simulated import Load, SimulatedService, _Pod

QUIET = Load(0.0, (50, 100), (100, 200))
SPIKE = Load(4.0, (50, 100), (100, 300))
PLANNER = PlannerConfig(min_decode_pods=1, max_decode_pods=4, interval_s=15.0,
                        scale_up_cooldown_s=30.0, scale_down_cooldown_s=60.0)


@dataclass
class Spec:
    autoscale: PlannerConfig
    prefill_threshold_tokens: int = 512


class SimulatedCluster:
    """``LocalCluster``'s autoscaling surface over a simulated service: its decode pods are
    the service's, started and retired by name; what the autoscaler called is recorded."""

    def __init__(self, directory: Path) -> None:
        self.spec = Spec(PLANNER)
        self.service = SimulatedService(Replicas(0, 1))
        self.planner_textfile = directory / "planner.prom"
        self.num_chains = 0
        self.retired: list[str] = []

    def decode_pods(self) -> list[_Pod]:
        return list(self.service.decode)

    def add_decode_worker(self) -> _Pod:
        self.service.resize(Replicas(0, len(self.service.decode) + 1))
        return self.service.decode[-1]

    def retire_decode_worker(self, name: str) -> None:
        self.service.decode = [pod for pod in self.service.decode if pod.name != name]
        self.retired.append(name)

    def metrics_targets(self) -> list:
        return []  # the scraper below reads the simulated pods directly


@pytest.fixture
def cluster(tmp_path):
    return SimulatedCluster(tmp_path)


def run(cluster: SimulatedCluster, autoscaler: LocalAutoscaler, load: Load,
        seconds: float) -> tuple[list[str], list[str]]:
    """Serve ``load`` for ``seconds``, one planner tick per interval: the changes made, and
    the pods the planner named for removal."""
    events, named = [], []
    for _ in range(round(seconds / PLANNER.interval_s)):
        cluster.service.run_interval(load, PLANNER.interval_s)
        events += autoscaler.tick()
        if autoscaler.last_decision.drain_decode_pod:
            named.append(autoscaler.last_decision.drain_decode_pod)
    return events, named


def test_a_spike_starts_pods_and_the_quiet_after_it_retires_the_named_ones_one_by_one(cluster):
    autoscaler = LocalAutoscaler(cluster, clock=lambda: cluster.service.time_s,
                                 scraper=lambda targets, now: cluster.service.scrape())
    assert autoscaler.tick() == []
    ups, _ = run(cluster, autoscaler, SPIKE, 180)
    assert ups and all("starting decode-" in event for event in ups), ups
    peak = len(cluster.decode_pods())
    assert peak >= 2 and cluster.retired == []

    downs, named = run(cluster, autoscaler, QUIET, 600)
    assert len(cluster.decode_pods()) == PLANNER.min_decode_pods
    assert len(cluster.retired) == peak - 1 == len(downs)
    assert cluster.retired == named, "the pod the planner named is the pod retired"
    assert all(f"(draining {name})" in event for event, name in zip(downs, named)), downs

    published = parse_pod("planner", "gateway", cluster.planner_textfile.read_text())
    assert published.value("baton_planner_target_replicas", role="decode") == 1
    assert published.value("baton_replicas", role="decode") == 1
    assert published.value("baton_replicas", role="prefill") == 0


def test_a_recorded_run_replays_to_the_same_decisions(cluster, tmp_path):
    """``--planner-trace``: every step written as it is taken, only the planner's series
    kept, and a fresh planner over the recording decides as the live one did."""
    path = tmp_path / "trace.jsonl.gz"
    autoscaler = LocalAutoscaler(cluster, clock=lambda: cluster.service.time_s,
                                 scraper=lambda targets, now: cluster.service.scrape(),
                                 trace_path=path)
    autoscaler.tick()
    run(cluster, autoscaler, SPIKE, 120)
    run(cluster, autoscaler, QUIET, 240)
    autoscaler.close()
    trace = read_trace(path)
    assert len(trace.steps) == 1 + 8 + 16 and trace.config == PLANNER
    assert {name for step in trace.steps for pod in step.scrape.pods for name in pod.samples} \
        <= {f"{series}{suffix}" for series in PLANNER_SERIES
            for suffix in ("", "_bucket", "_sum", "_count", "_created")}
    decisions = replay(trace)
    assert any(d.decode.changed for d in decisions)
    assert [(d.decode.target, d.decode.reason) for d in decisions] == \
        [step.decode for step in trace.steps]


def test_ticks_act_only_once_the_interval_has_passed(cluster):
    now = [0.0]
    scrapes = []
    autoscaler = LocalAutoscaler(cluster, clock=lambda: now[0],
                                 scraper=lambda targets, at: scrapes.append(at) or
                                 cluster.service.scrape())
    autoscaler.tick()
    now[0] = PLANNER.interval_s - 1
    autoscaler.tick()
    assert scrapes == [0.0] and autoscaler.seconds_to_next_tick() == 1
    now[0] = PLANNER.interval_s
    cluster.service.run_interval(QUIET, PLANNER.interval_s)
    autoscaler.tick()
    assert scrapes == [0.0, PLANNER.interval_s]


def test_a_cluster_without_planner_settings_is_refused(cluster):
    cluster.spec = Spec(None)
    with pytest.raises(ValueError, match="not autoscaled"):
        LocalAutoscaler(cluster)
