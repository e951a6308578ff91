"""How many tokens each layer keeps: the pyramid, its two baselines, and the generation schedule.

PyramidInfer's observation is that deeper layers need fewer keys: their
attention concentrates on fewer tokens. The paper prunes layer by layer, each
layer keeping a fraction of what the previous one kept, so the kept fraction
compounds with depth. We keep that shape:

    step fraction   s_l = exp(-a * w_l),  w_l = (1 - cos(pi * (l + 1) / L)) / 2
    layer fraction  f_l = s_0 * s_1 * ... * s_l          (compounded)

w_l rises along a cosine from ~0 (first layer) to 1 (last layer), so the step
fraction falls along a cosine in log space and the compounded fraction falls
ever faster with depth. The one free parameter ``a`` is solved by bisection so
that the layers' budgets sum to ``keep_ratio`` of the full cache (L x P tokens).
Every layer keeps at least its mandatory tokens (sinks + recent window), and a
layer whose budget would fall under ``min_context`` keeps everything (the
paper's minimum context: short contexts are not worth pruning).

The baselines of the benchmark share the floor and the keep-all rule:
"uniform" gives every layer keep_ratio x P, "local" does the same but keeps
only the most recent tokens (StreamingLLM). A policy is a ``BudgetPolicy`` registered in
``BUDGET_POLICIES`` (``baton.config.PYRAMID_POLICIES``, a ``baton.registry.Registry``)
under one of the names declared there.

The generation phase uses a steeper, non-compounded schedule: of each batch of
tokens that leaves the recent window, layer l keeps the fraction
``last + (first - last) * (1 + cos(pi * l / (L - 1))) / 2`` (0.9 at layer 0,
0.1 at the last layer by default).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import NamedTuple

from baton.config import PYRAMID_POLICIES, PyramidConfig


def recent_window(config: PyramidConfig, prompt_length: int) -> int:
    """Tokens at the end of the prompt that are always kept and whose queries score the rest.

    The last ``recent_ratio`` of the prompt, and at least the final token.
    """
    return max(1, round(config.recent_ratio * prompt_length))


def mandatory_tokens(config: PyramidConfig, prompt_length: int) -> int:
    """Sinks + recent window: what every layer keeps whatever its budget (never more than P)."""
    window = recent_window(config, prompt_length)
    sinks = min(config.num_sinks, prompt_length - window)
    return window + sinks


def _depth_weights(num_layers: int) -> list[float]:
    """w_l: rises along a cosine from ~0 at the first layer to 1 at the last."""
    return [(1.0 - math.cos(math.pi * (layer + 1) / num_layers)) / 2.0 for layer in range(num_layers)]


def _clamp_budgets(fractions: list[float], prompt_length: int, floor: int) -> list[int]:
    return [min(prompt_length, max(floor, round(f * prompt_length))) for f in fractions]


def _apply_min_context(config: PyramidConfig, budgets: list[int], prompt_length: int) -> list[int]:
    return [prompt_length if budget < config.min_context else budget for budget in budgets]


def pyramid_budgets(config: PyramidConfig, num_layers: int, prompt_length: int) -> list[int]:
    """Tokens kept per layer: compounded cosine decay summing to ~keep_ratio of the full cache."""
    floor = mandatory_tokens(config, prompt_length)
    target = config.keep_ratio * num_layers * prompt_length
    cumulative = []
    total = 0.0
    for weight in _depth_weights(num_layers):
        total += weight
        cumulative.append(total)

    def budgets_for(decay: float) -> list[int]:
        return _clamp_budgets([math.exp(-decay * c) for c in cumulative], prompt_length, floor)

    # sum(budgets_for(a)) falls monotonically from L*P (a = 0) to L*floor (a -> inf).
    low, high = 0.0, 1.0
    while sum(budgets_for(high)) > target and high < 1e4:
        low, high = high, high * 2.0
    for _ in range(60):
        middle = (low + high) / 2.0
        if sum(budgets_for(middle)) > target:
            low = middle
        else:
            high = middle
    best = min((low, high), key=lambda a: abs(sum(budgets_for(a)) - target))
    return _apply_min_context(config, budgets_for(best), prompt_length)


def uniform_budgets(config: PyramidConfig, num_layers: int, prompt_length: int) -> list[int]:
    """The same keep_ratio x P tokens in every layer (baseline)."""
    floor = mandatory_tokens(config, prompt_length)
    budgets = _clamp_budgets([config.keep_ratio] * num_layers, prompt_length, floor)
    return _apply_min_context(config, budgets, prompt_length)


class BudgetPolicy(NamedTuple):
    budgets: Callable[[PyramidConfig, int, int], list[int]]  # (config, layers, prompt) -> per layer
    by_attention: bool  # select kept tokens by recent-query attention (else by recency)


BUDGET_POLICIES = PYRAMID_POLICIES  # name -> BudgetPolicy
BUDGET_POLICIES.register("pyramid")(BudgetPolicy(pyramid_budgets, by_attention=True))
BUDGET_POLICIES.register("uniform")(BudgetPolicy(uniform_budgets, by_attention=True))
BUDGET_POLICIES.register("local")(BudgetPolicy(uniform_budgets, by_attention=False))


def layer_budgets(config: PyramidConfig, num_layers: int, prompt_length: int) -> list[int]:
    """Per-layer budgets of the configured policy (everything when compression is off)."""
    if not config.enabled or config.keep_ratio >= 1.0:
        return [prompt_length] * num_layers
    return BUDGET_POLICIES.get(config.policy).budgets(config, num_layers, prompt_length)


def generation_keep_counts(config: PyramidConfig, num_layers: int) -> list[int]:
    """Tokens each layer keeps of one batch of ``generation_update_every`` that left the window."""
    first, last = config.generation_keep_first, config.generation_keep_last
    batch = config.generation_update_every
    counts = []
    for layer in range(num_layers):
        progress = layer / (num_layers - 1) if num_layers > 1 else 0.0
        fraction = last + (first - last) * (1.0 + math.cos(math.pi * progress)) / 2.0
        counts.append(min(batch, max(1, round(fraction * batch))))
    return counts
