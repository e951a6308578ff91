"""Scrapes into observations: histogram deltas and quantiles, restarts, the series read."""

from __future__ import annotations

import pytest
from baton.metrics import DecodeMetrics, GatewayMetrics, PrefillMetrics
from baton.planner import ClusterScrape, parse_pod
from baton.planner import observation as obs
from baton.planner.model import BinnedPoints
from prometheus_client import CollectorRegistry, generate_latest


def _scrape(time_s: float, registry, role: str = "gateway", name: str = "gw") -> ClusterScrape:
    return ClusterScrape(time_s, (parse_pod(name, role, generate_latest(registry).decode()),))


def test_lengths_between_two_scrapes_and_their_quantiles():
    registry = CollectorRegistry()
    metrics = GatewayMetrics(registry, "m")
    metrics.record_lengths(100, 10)
    older = _scrape(0.0, registry)
    for prompt in range(1000, 2000, 10):  # 100 prompts spread over 1000..1990
        metrics.record_lengths(prompt, 50)
    seen = obs.observe(older, _scrape(10.0, registry))
    assert seen.request_rate_per_s == pytest.approx(10.0)
    assert seen.prompt_tokens.count == 100 and seen.prompt_tokens.mean == pytest.approx(1495)
    assert seen.prompt_tokens.quantile(0.9) == pytest.approx(1900, rel=0.05)
    assert seen.output_tokens.mean == pytest.approx(50)
    long = seen.prompt_tokens.above(1536)
    assert long.count == pytest.approx(46, abs=3)  # 1540..1990
    assert long.quantile(0.5) == pytest.approx(1765, rel=0.05)


def test_a_restarted_pod_counts_from_zero():
    registry = CollectorRegistry()
    metrics = PrefillMetrics(registry, "m")
    for _ in range(5):
        metrics.record_prefill(1000, 0.5)
    older = ClusterScrape(0.0, (parse_pod("p", "prefill", generate_latest(registry).decode(), "c0"),))
    fresh = CollectorRegistry()
    PrefillMetrics(fresh, "m").record_prefill(2000, 1.0)
    newer = ClusterScrape(5.0, (parse_pod("p", "prefill", generate_latest(fresh).decode(), "c0"),))
    (chain,) = obs.observe(older, newer).chains
    assert (chain.prompts, chain.prompt_tokens, chain.compute_s) == (1, 2000, 1.0)


def test_decode_pods_sequences_by_littles_law():
    registry = CollectorRegistry()
    metrics = DecodeMetrics(registry, "m")
    older = _scrape(0.0, registry, "decode", "d")
    for _ in range(400):  # 400 gaps of 0.1 s in 10 s: 4 sequences streaming at once
        metrics.time_between_tokens_s.observe(0.1)
    (pod,) = obs.observe(older, _scrape(10.0, registry, "decode", "d")).decode
    assert pod.mean_sequences == pytest.approx(4.0) and pod.whole_interval


def test_every_series_the_planner_reads_is_exported_by_the_pods():
    exported = set()
    for kind in (GatewayMetrics, DecodeMetrics, PrefillMetrics):
        registry = CollectorRegistry()
        kind(registry, "m")
        exported |= {sample.name for family in registry.collect() for sample in family.samples}
        exported |= {family.name for family in registry.collect()}
    read = [value for name, value in vars(obs).items() if name.isupper() and isinstance(value, str)]
    missing = [name for name in read if name not in exported and f"{name}_count" not in exported]
    assert not missing and len(read) >= 14
    assert set(obs.PLANNER_SERIES) == set(read)  # what a recorded trace keeps (trace.py)


def test_a_line_needs_two_loads_unless_it_may_go_through_the_origin():
    points = BinnedPoints()
    for _ in range(5):
        points.add(10, 0.1)
    assert points.fit(through_origin_when_one_bin=False) is None
    assert points.fit(through_origin_when_one_bin=True).slope == pytest.approx(0.01)
    for x in (2, 40):
        points.add(x, 0.02 + 0.008 * x)
    line = points.fit(through_origin_when_one_bin=False)
    assert line.slope > 0 and line.intercept >= 0
