"""Operator tests run against kmock's Kubernetes emulator (see emulated_cluster.py)."""

from __future__ import annotations

import pytest
from emulated_cluster import EmulatedCluster


@pytest.fixture
def cluster():
    emulated = EmulatedCluster()
    yield emulated
    emulated.close()
