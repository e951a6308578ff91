"""A build on a short-lived thread returns its value or raises its error, and leaves no
OpenMP pool behind (the threads libgomp started for it exit with it)."""

import time
from pathlib import Path

import pytest
import torch
from baton.compute_thread import build_on_short_lived_thread


def _num_threads() -> int:
    return len(list(Path("/proc/self/task").iterdir()))


def test_returns_the_value() -> None:
    assert build_on_short_lived_thread(lambda: 42) == 42


def test_raises_the_builds_error() -> None:
    def fail() -> None:
        raise ValueError("no such model")

    with pytest.raises(ValueError, match="no such model"):
        build_on_short_lived_thread(fail)


@pytest.mark.skipif(not Path("/proc/self/task").exists(), reason="counts threads in /proc")
def test_the_parallel_work_leaves_no_threads_behind() -> None:
    previous = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        before = _num_threads()
        # large enough for torch to start a parallel region (and libgomp a pool) on that thread
        total = build_on_short_lived_thread(lambda: float((torch.ones(1 << 22) * 2).sum()))
        assert total == 2.0 * (1 << 22)
        deadline = time.monotonic() + 10.0  # the pool's workers exit just after the thread
        while _num_threads() > before and time.monotonic() < deadline:
            time.sleep(0.01)
        assert _num_threads() == before
    finally:
        torch.set_num_threads(previous)
