"""One reading of every pod's Prometheus metrics, as plain numbers the planner can subtract.

A ``PodScrape`` is one pod's ``/metrics`` text parsed once (``parse_pod``); a
``ClusterScrape`` is all of them at one moment. Counters and histograms only mean
something as differences between two scrapes (``observation.py`` takes them); gauges are
read as they are. Nothing here does I/O: whoever fetches the text (the operator, the local
supervisor, a test replaying a recorded trace) hands it in.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, field

from prometheus_client.parser import text_string_to_metric_families

PLANNED_ROLES = ("prefill", "decode")
SCRAPED_ROLES = ("gateway", *PLANNED_ROLES)

Labels = tuple[tuple[str, str], ...]  # sorted (name, value) pairs: hashable


@dataclass(frozen=True)
class PodScrape:
    """One pod's samples: ``samples[name][labels] = value`` (histograms as their ``_bucket``,
    ``_sum`` and ``_count`` series, counters with their ``_total`` suffix)."""

    pod: str
    role: str
    chain: str = ""  # prefill pods: the chain they belong to
    samples: Mapping[str, Mapping[Labels, float]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.role not in SCRAPED_ROLES:
            raise ValueError(f"a scraped pod's role must be one of {SCRAPED_ROLES}, got {self.role!r}")

    def value(self, name: str, **labels: str) -> float:
        """The sum of ``name`` over the series whose labels include ``labels`` (0 when absent)."""
        wanted = set(labels.items())
        return sum(v for key, v in self.samples.get(name, {}).items() if wanted <= set(key))

    def has(self, name: str) -> bool:
        return name in self.samples

    def buckets(self, name: str, **labels: str) -> dict[float, float]:
        """A histogram's cumulative bucket counts by upper bound, summed over other labels."""
        wanted = set(labels.items())
        result: dict[float, float] = {}
        for key, v in self.samples.get(f"{name}_bucket", {}).items():
            if wanted <= set(key):
                bound = float(dict(key)["le"])
                result[bound] = result.get(bound, 0.0) + v
        return result


def parse_pod(pod: str, role: str, text: str, chain: str = "") -> PodScrape:
    """Parse one ``/metrics`` answer (Prometheus text format)."""
    samples: dict[str, dict[Labels, float]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if math.isnan(sample.value):
                continue
            key = tuple(sorted(sample.labels.items()))
            samples.setdefault(sample.name, {})[key] = float(sample.value)
    return PodScrape(pod, role, chain, samples)


@dataclass(frozen=True)
class ClusterScrape:
    """Every pod's scrape at one moment (``time_s`` on the planner's clock)."""

    time_s: float
    pods: tuple[PodScrape, ...]

    def of_role(self, role: str) -> list[PodScrape]:
        return [pod for pod in self.pods if pod.role == role]

    def by_name(self) -> dict[str, PodScrape]:
        return {pod.pod: pod for pod in self.pods}

    def chains(self) -> dict[str, list[PodScrape]]:
        """Prefill pods grouped by chain, in chain order."""
        grouped: dict[str, list[PodScrape]] = {}
        for pod in sorted(self.of_role("prefill"), key=lambda p: chain_order(p.chain)):
            grouped.setdefault(pod.chain, []).append(pod)
        return grouped


def chain_order(chain: str) -> tuple:
    """Sort key that puts ``svc-prefill-2`` before ``svc-prefill-10``."""
    return tuple(int(part) if part.isdigit() else part for part in re.split(r"(\d+)", chain))
