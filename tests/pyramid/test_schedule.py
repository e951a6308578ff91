"""Per-layer budgets: the compounded pyramid, its baselines, the generation schedule, settings."""

from __future__ import annotations

import itertools

import pytest
from baton.config import PyramidConfig
from baton.pyramid import (
    generation_keep_counts,
    layer_budgets,
    mandatory_tokens,
    pyramid_budgets,
    recent_window,
    request_config,
    uniform_budgets,
)


@pytest.mark.parametrize("num_layers", [4, 12, 32])
@pytest.mark.parametrize("keep_ratio", [0.3, 0.45, 0.6, 0.8])
def test_pyramid_budgets_hit_the_ratio_and_fall_with_depth(num_layers, keep_ratio):
    prompt_length = 1000
    config = PyramidConfig(keep_ratio=keep_ratio)
    budgets = pyramid_budgets(config, num_layers, prompt_length)
    floor = mandatory_tokens(config, prompt_length)
    assert len(budgets) == num_layers
    assert abs(sum(budgets) - keep_ratio * num_layers * prompt_length) <= num_layers
    assert all(a >= b for a, b in itertools.pairwise(budgets)), budgets
    assert all(floor <= b <= prompt_length for b in budgets)
    assert budgets[0] > budgets[-1]


def test_the_pyramid_compounds_steps_that_fall_along_a_cosine():
    # Step fractions b_l / b_(l-1) fall with depth (until the floor): pruning compounds.
    budgets = pyramid_budgets(PyramidConfig(keep_ratio=0.8), 8, 10_000)
    steps = [b / a for a, b in itertools.pairwise(budgets)]
    assert all(s1 > s2 for s1, s2 in itertools.pairwise(steps)), steps


def test_recent_window_and_sinks_set_the_floor():
    config = PyramidConfig(keep_ratio=0.05)
    assert recent_window(config, 1000) == 200
    assert mandatory_tokens(config, 1000) == 204
    assert pyramid_budgets(config, 6, 1000) == [204] * 6
    assert recent_window(config, 2) == 1  # the final token at least


def test_a_layer_under_min_context_keeps_everything():
    config = PyramidConfig(keep_ratio=0.5, min_context=64)
    budgets = pyramid_budgets(config, 8, 150)  # floor 34: deep layers would fall under 64
    assert all(b >= 64 or b == 150 for b in budgets)
    assert 150 in budgets[1:]


def test_full_budget_or_disabled_keeps_everything():
    assert layer_budgets(PyramidConfig(keep_ratio=1.0), 5, 700) == [700] * 5
    assert layer_budgets(PyramidConfig(enabled=False), 5, 700) == [700] * 5


def test_uniform_and_local_give_every_layer_the_same_budget():
    for policy in ("uniform", "local"):
        config = PyramidConfig(keep_ratio=0.45, policy=policy)
        assert layer_budgets(config, 6, 1000) == [450] * 6
    assert uniform_budgets(PyramidConfig(keep_ratio=0.1), 3, 1000) == [204] * 3


def test_generation_schedule_is_steeper_and_falls_from_first_to_last():
    counts = generation_keep_counts(PyramidConfig(), 8)
    assert counts[0] == round(0.9 * 16) and counts[-1] == round(0.1 * 16)
    assert all(a >= b for a, b in itertools.pairwise(counts))
    assert generation_keep_counts(PyramidConfig(), 1) == [round(0.9 * 16)]


def test_request_overrides_and_their_errors():
    deployment = PyramidConfig(keep_ratio=0.5)
    assert request_config(deployment) is deployment
    assert request_config(deployment, keep_ratio=0.3).keep_ratio == 0.3
    off = request_config(deployment, enabled=False)
    assert not off.enabled and layer_budgets(off, 4, 500) == [500] * 4
    with pytest.raises(ValueError, match="1.5"):
        request_config(deployment, keep_ratio=1.5)
    with pytest.raises(ValueError, match="0.0"):
        PyramidConfig(keep_ratio=0.0)
    with pytest.raises(ValueError, match="'bogus'"):
        PyramidConfig(policy="bogus")
