"""One PodDisruptionBudget per role: how many of its pods a node drain (or any eviction)
may take at once.

A prefill chain is one unit. Its p ranks are one StatefulSet, and each rank is a single
point of failure: losing any one stops the chain until that rank is back. So a budget of
k chains is one budget over every rank of every chain allowing k pods at once: each
evicted pod stops at most one chain, hence at most k chains are down. One budget per
StatefulSet, the natural choice for most workloads, would let a drain take one rank of
every chain at once, which is every chain. (An eviction is refused for a pod that two
budgets select, so it is the one or the other.)

Pods that are not ready may be evicted whatever the budget (``unhealthyPodEvictionPolicy:
AlwaysAllow``): a pod that never turned ready, or stopped being, holds no drain.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from baton_operator.layout import labels, selector

ROLES = ("gateway", "redis", "prefill", "decode")


@dataclass(frozen=True)
class DisruptionBudget:
    enabled: bool = True
    max_unavailable: int = 1  # pods; for prefill, chains



def read(budget: Any, where: str) -> DisruptionBudget:
    """``spec.<role>.podDisruptionBudget``; raises ``TypeError`` or ``ValueError`` naming
    a bad value."""
    budget = budget or {}
    if not isinstance(budget, dict):
        raise TypeError(f"{where} must be an object, got {budget!r}")
    enabled = budget.get("enabled", DisruptionBudget.enabled)
    if not isinstance(enabled, bool):
        raise TypeError(f"{where}.enabled must be true or false, got {enabled!r}")
    count = budget.get("maxUnavailable", DisruptionBudget.max_unavailable)
    if not isinstance(count, int) or isinstance(count, bool) or count < 0:
        raise ValueError(f"{where}.maxUnavailable must be an integer >= 0, got {count!r}")
    return DisruptionBudget(enabled=enabled, max_unavailable=count)


def disruption_budgets(name: str, budgets: dict[str, DisruptionBudget],
                       roles: tuple[str, ...]) -> list[dict]:
    """The budgets of ``roles`` (the roles that have pods) that are enabled."""
    return [{
        "apiVersion": "policy/v1", "kind": "PodDisruptionBudget",
        "metadata": {"name": f"{name}-{role}", "labels": labels(name, role)},
        "spec": {"selector": {"matchLabels": selector(name, role)},
                 # a chain's ranks: one pod, one chain (see above)
                 "maxUnavailable": budgets[role].max_unavailable,
                 "unhealthyPodEvictionPolicy": "AlwaysAllow"},
    } for role in roles if budgets[role].enabled]
