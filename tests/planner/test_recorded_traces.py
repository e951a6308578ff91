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


def test_the_recorded_climb_was_answered_at_once_and_left_after_the_cool_down(ramp):
    """What the live planner did, against the load its own scrapes show: the second pod came
    in the interval the rate peaked (over twice the run's mean), and went once the rate had
    fallen, no sooner than the cool-down after it came. The second climb stayed within one
    pod's measured share at the ITL target (the gateway saw ITL P90 at about half of it),
    so it was rightly not answered with a pod."""
    config = ramp.config
    changes = _changes(ramp)
    assert [(before, after) for _, before, after in changes] == [(1, 2), (2, 1)], changes
    (up, _, _), (down, _, _) = changes
    rates = dict(_rates(ramp))
    mean_rate = sum(rates.values()) / len(rates)
    assert rates[up] >= 2 * mean_rate and rates[up] == max(r for t, r in rates.items() if t <= up)
    assert down - up >= config.scale_down_cooldown_s
    assert rates[down] < rates[up] / 2


def _raised_at(trace, config) -> list[float]:
    """When a planner with ``config``, replayed over ``trace``, asks for more decode pods."""
    start = trace.steps[0].scrape.time_s
    return [step.scrape.time_s - start for step, decision in zip(trace.steps, replay(trace, config))
            if decision.decode.target > step.current.decode_pods]


def test_a_tighter_target_answers_both_climbs_and_no_quiet_phase(ramp):
    """Counterfactual on the recorded measurements: with the ITL target a quarter tighter,
    a second pod is asked for in both climbs of 5 requests/s, and never while 2 or fewer
    come (the climbs: 90-165 s and 300-360 s of load, plus an interval's lag)."""
    tighter = dataclasses.replace(ramp.config, itl_p90_s=0.75 * ramp.config.itl_p90_s)
    raised = _raised_at(ramp, tighter)
    climbs = [(90, 170), (300, 365)]
    assert all(any(low <= t <= high for low, high in climbs) for t in raised), raised
    assert all(any(low <= t <= high for t in raised) for low, high in climbs), raised


def test_the_same_load_under_a_looser_target_keeps_one_pod(ramp):
    """With an ITL target five times looser, one pod carries the peak: never a second."""
    looser = dataclasses.replace(ramp.config, itl_p90_s=5 * ramp.config.itl_p90_s)
    assert _raised_at(ramp, looser) == []


def test_a_pod_bound_of_one_holds_whatever_the_load(ramp):
    """Bounds before everything: told of two pods above a maximum of one, it asks for one
    at once, whatever the cool-downs say."""
    capped = dataclasses.replace(ramp.config, max_decode_pods=1)
    decisions = replay(ramp, capped)
    assert all(decision.decode.target == 1 for decision in decisions)
    above = [d.decode.reason for d, step in zip(decisions, ramp.steps)
             if step.current.decode_pods == 2]
    assert above and all(reason == "2 is outside the bounds 1..1" for reason in above), above
