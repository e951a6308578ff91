"""The planner on a recorded trace: `bench/autoscale.py --planner-trace` on `baton up
--autoscale` (one to two decode pods, a Poisson load stepping 0.5 -> 2 -> 5 -> 2 -> 1 -> 5
-> 2 -> 0.5 -> 0 requests/s), every scrape the live planner read, the sizes it was told and
what it decided (baton.planner.trace).

A fresh planner replayed over it must decide exactly as the live one did, at the same
moments; what it decided must answer the load the scrapes themselves show; and replayed
under other targets, the same measurements must move it the way those targets ask.
"""

from __future__ import annotations

import dataclasses
import itertools
from pathlib import Path

import pytest
from baton.planner.observation import observe
from baton.planner.trace import read_trace, replay

TRACES = Path(__file__).parent / "traces"
RAMP = TRACES / "autoscale-ramp.jsonl.gz"


@pytest.fixture(scope="module")
def ramp():
    return read_trace(RAMP)


def _changes(trace) -> list[tuple[float, int, int]]:
    """(seconds since the first step, decode pods before, after) for every decode change."""
    start = trace.steps[0].scrape.time_s
    return [(step.scrape.time_s - start, step.current.decode_pods, step.decode[0])
            for step in trace.steps if step.decode[0] != step.current.decode_pods]


def _rates(trace) -> list[tuple[float, float]]:
    """(seconds since the first step, requests/s over the interval ending there)."""
    start = trace.steps[0].scrape.time_s
    return [(newer.scrape.time_s - start, observe(older.scrape, newer.scrape).request_rate_per_s)
            for older, newer in itertools.pairwise(trace.steps)]


@pytest.mark.parametrize("path", sorted(TRACES.glob("*.jsonl.gz")), ids=lambda p: p.name)
def test_a_replayed_planner_decides_as_the_live_one_did(path):
    trace = read_trace(path)
    assert len(trace.steps) >= 20
    for step, decision in zip(trace.steps, replay(trace), strict=True):
        assert (decision.decode.target, decision.decode.reason) == step.decode, step.scrape.time_s
        assert (decision.prefill.target, decision.prefill.reason) == step.prefill, step.scrape.time_s
        assert decision.drain_decode_pod == step.drain


CLIMBS = ((90, 170), (300, 365))  # the 5 requests/s phases, plus an interval's lag


def _in_climb(t: float) -> bool:
    return any(low <= t <= high for low, high in CLIMBS)


def test_each_climb_was_answered_and_left_after_the_cool_down(ramp):
    """What the live planner did, against the load its own scrapes show: a second pod in
    each climb, where the interval's rate was over twice the run's mean; retired once the
    rate had fallen below half of what brought it, no sooner than the cool-down after it."""
    config = ramp.config
    changes = _changes(ramp)
    assert [(before, after) for _, before, after in changes] == [(1, 2), (2, 1)] * 2, changes
    rates = dict(_rates(ramp))
    mean_rate = sum(rates.values()) / len(rates)
    for (up, _, _), (down, _, _) in zip(changes[::2], changes[1::2]):
        assert _in_climb(up) and rates[up] >= 2 * mean_rate, (up, rates[up], mean_rate)
        assert not _in_climb(down) and down - up >= config.scale_down_cooldown_s, (up, down)
        assert rates[down] < rates[up] / 2, (rates[up], rates[down])


def _raised_at(trace, config) -> list[float]:
    """When a planner with ``config``, replayed over ``trace``, asks for more decode pods."""
    start = trace.steps[0].scrape.time_s
    return [step.scrape.time_s - start for step, decision in zip(trace.steps, replay(trace, config))
            if decision.decode.target > step.current.decode_pods]


def test_a_tighter_target_asks_at_least_as_often_and_a_looser_one_never(ramp):
    """Counterfactuals on the recorded measurements: tightening the ITL target never takes
    a scale-up away (a quarter tighter, it also asks during the 2 requests/s phase before
    the first climb), and with a target five times looser one pod carries the peaks."""
    def raised(factor: float) -> list[float]:
        return _raised_at(ramp, dataclasses.replace(
            ramp.config, itl_p90_s=factor * ramp.config.itl_p90_s))

    live = raised(1.0)
    assert [t for t, before, after in _changes(ramp) if after > before] == live
    tighter = raised(0.75)
    assert set(live) < set(tighter) and min(tighter) < CLIMBS[0][0], (live, tighter)
    assert raised(5.0) == []
def test_a_pod_bound_of_one_holds_whatever_the_load(ramp):
    """Bounds before everything: told of two pods above a maximum of one, it asks for one
    at once, whatever the cool-downs say."""
    capped = dataclasses.replace(ramp.config, max_decode_pods=1)
    decisions = replay(ramp, capped)
    assert all(decision.decode.target == 1 for decision in decisions)
    above = [d.decode.reason for d, step in zip(decisions, ramp.steps)
             if step.current.decode_pods == 2]
    assert above and all(reason == "2 is outside the bounds 1..1" for reason in above), above
