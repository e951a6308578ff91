"""Operator tests run against kmock's Kubernetes emulator (see emulated_cluster.py)."""

from __future__ import annotations

import pytest
from emulated_cluster import EmulatedCluster
from metrics_pods import Pods


@pytest.fixture
def cluster():
    emulated = EmulatedCluster()
    yield emulated
    emulated.close()


@pytest.fixture
def pods(cluster):
    """Pods of the service "demo" with live metrics endpoints (metrics_pods.py)."""
    pods = Pods(cluster)
    yield pods
    pods.close()
