"""A build on a short-lived thread returns its value or raises its error, and leaves no
OpenMP pool behind (the threads libgomp started for it exit with it)."""

import subprocess
import sys
from pathlib import Path

import pytest
from baton.compute_thread import build_on_short_lived_thread


def test_returns_the_value() -> None:
    assert build_on_short_lived_thread(lambda: 42) == 42


def test_raises_the_builds_error() -> None:
    def fail() -> None:
        raise ValueError("no such model")

    with pytest.raises(ValueError, match="no such model"):
        build_on_short_lived_thread(fail)


# Run in a fresh interpreter: in the test process, threads that other tests started come and
# go on their own schedule and would move the count either way.
LEFTOVER_THREADS = """
import time
from pathlib import Path

import torch
from baton.compute_thread import build_on_short_lived_thread


def num_threads() -> int:
    return len(list(Path("/proc/self/task").iterdir()))


torch.set_num_threads(2)
before = num_threads()
# large enough for torch to start a parallel region (and libgomp a pool) on that thread
total = build_on_short_lived_thread(lambda: float((torch.ones(1 << 22) * 2).sum()))
assert total == 2.0 * (1 << 22), total
deadline = time.monotonic() + 10.0  # the pool's workers exit just after the thread
while num_threads() > before and time.monotonic() < deadline:
    time.sleep(0.01)
print(before, num_threads())
"""


@pytest.mark.skipif(not Path("/proc/self/task").exists(), reason="counts threads in /proc")
def test_the_parallel_work_leaves_no_threads_behind() -> None:
    done = subprocess.run([sys.executable, "-c", LEFTOVER_THREADS], capture_output=True, text=True,
                          timeout=120, check=False)
    assert done.returncode == 0, done.stderr
    before, after = map(int, done.stdout.split())
    assert after == before
