"""Fetching the pods' ``/metrics`` for the planner: the one piece of it that does I/O.

A pod that does not answer within ``timeout_s`` is left out of that scrape (it may be
starting or draining); the planner then sees its counters from zero again when it comes
back, as Prometheus would. Fetches run in parallel threads, each bounded.
"""

from __future__ import annotations

import logging
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from baton.planner.samples import ClusterScrape, PodScrape, parse_pod

log = logging.getLogger(__name__)

SCRAPE_TIMEOUT_S = 3.0
MAX_PARALLEL = 16


@dataclass(frozen=True)
class Target:
    """A pod whose metrics the planner reads: its name, role, chain and /metrics URL."""

    pod: str
    role: str
    url: str
    chain: str = ""


def fetch(url: str, timeout_s: float = SCRAPE_TIMEOUT_S) -> str:
    with urllib.request.urlopen(url, timeout=timeout_s) as response:
        return response.read().decode()


def _scrape_one(target: Target, timeout_s: float) -> PodScrape | None:
    try:
        return parse_pod(target.pod, target.role, fetch(target.url, timeout_s), target.chain)
    except (OSError, ValueError) as e:
        log.info("no metrics from %s (%s): %s", target.pod, target.url, e)
        return None


def scrape(targets: list[Target], time_s: float, timeout_s: float = SCRAPE_TIMEOUT_S) -> ClusterScrape:
    """Every target's metrics, stamped ``time_s`` (the planner's clock, read by the caller)."""
    if not targets:
        return ClusterScrape(time_s, ())
    with ThreadPoolExecutor(min(MAX_PARALLEL, len(targets))) as pool:
        pods = list(pool.map(lambda target: _scrape_one(target, timeout_s), targets))
    return ClusterScrape(time_s, tuple(pod for pod in pods if pod is not None))
