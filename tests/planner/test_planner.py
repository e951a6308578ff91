"""The planner on synthetic traces from a simulated service (simulated.py): what it decides
and when, with the clock in the test's hands."""

from __future__ import annotations

import itertools
import json
import math

import pytest
from baton.config import PlannerConfig
from baton.planner import Planner, Replicas
from simulated import THRESHOLD, Load, SimulatedService, run

SHORT = (50, 400)  # prompt tokens: prefilled on the decode pods (below THRESHOLD)
LONG = (1500, 3000)  # prompt tokens: the chains' work


def _simulate(trace, duration_s: float, start: Replicas, **config):
    clock = [0.0]
    planner = Planner(PlannerConfig(**config), THRESHOLD, clock=lambda: clock[0])
    service = SimulatedService(start)
    return run(trace, planner, service, duration_s, clock), planner


def _changes(steps, role: str) -> list[tuple[float, int]]:
    """(time, new count) whenever ``role`` changed."""
    result, last = [], None
    for step in steps:
        count = step.replicas.of(role)
        if last is not None and count != last:
            result.append((step.time_s, count))
        last = count
    return result


def _at(steps, time_s: float) -> Replicas:
    return next(step.replicas for step in steps if step.time_s >= time_s)


def test_a_ramp_raises_decode_pods_step_by_step_and_never_lowers_them():
    steps, planner = _simulate(lambda t: Load(0.3 + 2.7 * min(t, 600) / 600, SHORT, (100, 300)),
                               720, Replicas(0, 1), max_decode_pods=8)
    decode = _changes(steps, "decode")
    counts = [count for _, count in decode]
    assert counts == sorted(counts), f"a ramp lowered decode pods: {decode}"
    # 3 req/s x 200 tokens at ITL 0.2 s, ~25 sequences per pod within it: about 5 pods.
    assert 4 <= steps[-1].replicas.decode_pods <= 6, decode
    assert steps[-1].replicas.prefill_chains == 0  # no prompt long enough for a chain
    assert planner.model.itl is not None and planner.model.itl.slope > 0
    # Until the model has measurements at two loads, a pod meeting its target is left alone.
    assert _at(steps, 30).decode_pods == 1


def test_a_spike_scales_up_at_once_and_down_only_after_the_cool_down():
    def trace(t):
        return Load(3.0 if 300 <= t < 390 else 0.5, SHORT, (100, 300))

    steps, _ = _simulate(trace, 1200, Replicas(0, 1), max_decode_pods=8,
                         scale_down_cooldown_s=120)
    decode = _changes(steps, "decode")
    moves = [(t, count - before) for (t, count), (_, before) in zip(decode, [(0, 1), *decode])]
    spike_ups = [t for t, step in moves if step > 0 and t >= 300]
    downs = [t for t, step in moves if step < 0]
    assert spike_ups and spike_ups[0] <= 315, f"the spike was answered late: {decode}"
    assert max(count for _, count in decode) >= 4
    assert downs, f"never scaled down after the spike: {decode}"
    assert downs[0] >= 390 + 120, f"scaled down before the cool-down: {decode}"
    assert all(step == -1 for _, step in moves if step < 0), f"more than one pod at once: {decode}"
    assert all(b - a >= 120 for a, b in itertools.pairwise(downs)), \
        f"scale-downs closer than the cool-down: {downs}"
    assert steps[-1].replicas.decode_pods <= 2, decode


def test_a_diurnal_load_is_followed_without_flapping():
    period_s = 1800.0

    def trace(t):
        return Load(1.6 + 1.3 * math.sin(2 * math.pi * t / period_s), SHORT, (100, 300))

    steps, _ = _simulate(trace, 1.5 * period_s, Replicas(0, 2), max_decode_pods=8,
                         scale_down_cooldown_s=120)
    peak = _at(steps, period_s / 4 + 60).decode_pods  # shortly after the first peak
    trough = _at(steps, 3 * period_s / 4 + 240).decode_pods  # after the trough and a cool-down
    assert peak >= trough + 2, f"peak {peak} vs trough {trough}"
    decode = _changes(steps, "decode")
    moves = [count - before for (_, count), (_, before) in zip(decode[1:], decode)]
    reversals = sum(a * b < 0 for a, b in itertools.pairwise(moves))
    assert reversals <= 3, f"flapping: {decode}"  # up to the peak, down to the trough, up again


def test_a_prompt_length_shift_moves_capacity_from_decode_to_prefill():
    def trace(t):
        return Load(2.0, SHORT, (200, 400)) if t < 600 else Load(2.0, LONG, (20, 60))

    steps, planner = _simulate(trace, 1500, Replicas(0, 4), max_decode_pods=8,
                               max_prefill_chains=4, ttft_p90_s=3.0, scale_down_cooldown_s=120)
    before = _at(steps, 590)
    assert before.prefill_chains == 0 and before.decode_pods >= 4
    prefill = _changes(steps, "prefill")
    assert prefill and 600 < prefill[0][0] <= 630, f"chains came late: {prefill}"
    assert 2 <= steps[-1].replicas.prefill_chains <= 4, prefill
    decode = _changes(steps, "decode")
    downs = [t for (t, count), (_, before) in zip(decode[1:], decode) if count < before and t > 600]
    assert downs and downs[0] >= 600 + 120, f"decode lowered before the cool-down: {decode}"
    assert steps[-1].replicas.decode_pods <= 2, decode
    # The prefill line is the simulated truth, fitted from the chains' own counters.
    assert planner.model.prefill.slope == pytest.approx(0.0004, rel=0.05)
    assert planner.model.prefill.intercept == pytest.approx(0.05, abs=0.01)


def test_a_busy_chain_is_not_removed_until_it_is_idle():
    clock = [0.0]
    planner = Planner(PlannerConfig(scale_down_cooldown_s=30), THRESHOLD, clock=lambda: clock[0])
    service = SimulatedService(Replicas(2, 1))
    planner.observe(service.scrape())
    busy = service.chains[-1].metrics.queued_requests
    reasons = []
    for _ in range(8):  # only short prompts: the chains are not needed
        service.run_interval(Load(0.5, SHORT, (50, 100)), 15)
        busy.set(3)  # but the last chain still holds requests
        clock[0] = service.time_s
        planner.observe(service.scrape())
        decision = planner.decide(service.replicas)
        assert decision.prefill.target == 2
        reasons.append(decision.prefill.reason)
    assert "not removed until idle" in reasons[-1], reasons
    busy.set(0)
    service.run_interval(Load(0.5, SHORT, (50, 100)), 15)
    clock[0] = service.time_s
    planner.observe(service.scrape())
    decision = planner.decide(service.replicas)
    assert decision.prefill.target == 1, decision.prefill.reason


def test_a_scale_down_names_the_decode_pod_with_the_fewest_sequences():
    clock = [0.0]
    planner = Planner(PlannerConfig(scale_down_cooldown_s=0), THRESHOLD, clock=lambda: clock[0])
    service = SimulatedService(Replicas(0, 3))
    planner.observe(service.scrape())
    decision = None
    for _ in range(12):
        service.run_interval(Load(1.0, SHORT, (100, 200)), 15)
        service.decode[1].metrics.running_sequences.set(0)  # the emptiest pod
        clock[0] = service.time_s
        planner.observe(service.scrape())
        decision = planner.decide(service.replicas)
        if decision.decode.target < 3:
            break
    assert decision.decode.target == 2, decision.decode.reason
    assert decision.drain_decode_pod == service.decode[1].name


def test_no_decision_before_two_scrapes():
    planner = Planner(PlannerConfig(), THRESHOLD, clock=lambda: 0.0)
    decision = planner.decide(Replicas(1, 2))
    assert decision.target == Replicas(1, 2) and not decision.changed
    assert "second scrape" in decision.decode.reason


def test_a_snapshot_carries_the_model_and_the_cool_downs_through_json():
    """What an operator writes to the service's status and a successor reads back: the
    model's measurements and each role's timers, a change aged by the time in between,
    wanting fewer resumed where it stopped (nobody watched the load meanwhile)."""
    def trace(t):
        return Load(3.0 if t < 120 else 0.3, SHORT, (100, 300))

    steps, planner = _simulate(trace, 240, Replicas(0, 1), max_decode_pods=8)
    assert _changes(steps, "decode"), "the burst should have raised decode pods"
    saved = json.loads(json.dumps(planner.snapshot()))
    roles = saved["roles"]
    assert roles["decode"]["secondsSinceChange"] > 0 and "secondsSinceChange" not in roles["prefill"]
    assert roles["decode"]["wantedFewerForSeconds"] > 0  # the burst is over

    clock = [10_000.0]  # a new process's clock
    restored = Planner(planner.config, THRESHOLD, clock=lambda: clock[0])
    restored.restore(saved, elapsed_s=25.0)
    assert restored.model.itl == planner.model.itl and restored.model.itl is not None
    assert restored.model.itl_points == planner.model.itl_points
    again = restored.snapshot()["roles"]
    assert again["decode"]["secondsSinceChange"] == pytest.approx(
        roles["decode"]["secondsSinceChange"] + 25.0)
    assert again["decode"]["wantedFewerForSeconds"] == roles["decode"]["wantedFewerForSeconds"]
    assert again["prefill"] == roles["prefill"]


@pytest.mark.parametrize("saved", [{}, {"version": 2}, {"version": 1, "model": {}, "roles": {}},
                                   "text"])
def test_a_damaged_snapshot_is_refused_and_changes_nothing(saved):
    planner = Planner(PlannerConfig(), THRESHOLD, clock=lambda: 0.0)
    before = planner.snapshot()
    with pytest.raises(ValueError, match="not a planner snapshot"):
        planner.restore(saved, 0.0)
    assert planner.snapshot() == before
    with pytest.raises(ValueError, match="elapsed_s"):
        planner.restore(before, -1.0)


@pytest.mark.parametrize("values", [{"min_decode_pods": 3, "max_decode_pods": 2},
                                    {"min_decode_pods": 0}, {"itl_p90_s": 0},
                                    {"window_s": 5, "interval_s": 10}, {"scale_down_margin": 1.0}])
def test_bad_planner_settings_are_refused(values):
    with pytest.raises(ValueError, match="planner"):
        PlannerConfig(**values)
