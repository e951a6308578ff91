"""The peer benchmark's CPU accounting (bench/peer/timing.py): a timed window splits its
process tree's CPU by role, as peer.md's served table reports it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench" / "peer"))
import timing as peer_timing
from timing import CpuWindow

BURN_S = 0.3
# Burns BURN_S of CPU, then stays alive (a server between runs).
BURN = f"""
import time
start = time.process_time()
while time.process_time() - start < {BURN_S}:
    pass
time.sleep(60)
"""
# A process of a role of its own (ROLE) that starts a child whose command line names none.
ROLE = ("peer-timing-test-server", "test server")
SERVER = f"""
import subprocess, sys
child = subprocess.Popen([sys.executable, "-c", {BURN!r}])
exec({BURN!r})
"""


def test_a_window_splits_its_tree_by_role_and_an_unnamed_child_takes_its_parents(monkeypatch):
    # A role no other process has (the session's cluster, a child of this process too,
    # has a gateway and decode pods of its own).
    monkeypatch.setattr(peer_timing, "ROLES", (ROLE, *peer_timing.ROLES))
    server = None
    try:
        with CpuWindow("client") as window:
            server = subprocess.Popen([sys.executable, "-c", SERVER, ROLE[0]], start_new_session=True)
            wait_until_burnt(server.pid)  # this process sleeps meanwhile
    finally:
        if server is not None:  # the server and its child, still alive when the window closed
            os.killpg(server.pid, signal.SIGKILL)
            server.wait()
    assert 2 * BURN_S - 0.05 <= window.by_role[ROLE[1]] <= 2 * BURN_S + 0.2  # its own + its child's
    assert window.by_role["client"] < BURN_S
    assert window.own_cpu_s >= window.by_role[ROLE[1]]


def wait_until_burnt(pid: int, timeout_s: float = 30.0) -> None:
    """Until ``pid`` and its child have each spent BURN_S of CPU. Reads only those two
    processes' counters: a scan of every process, repeated while a loaded machine takes
    its time, would cost this process (the window's client) more CPU than it may spend."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        burnt = [cpu_seconds(member) for member in (pid, *children(pid))]
        if len(burnt) == 2 and min(burnt) >= BURN_S - 0.01:
            return
        time.sleep(0.1)
    raise AssertionError(f"process {pid} and its child did not burn {BURN_S} s each in {timeout_s} s")


def children(pid: int) -> list[int]:
    try:
        return [int(child) for child in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except OSError:
        return []


def cpu_seconds(pid: int) -> float:
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs 2 CPUs to move a process between")
def test_pinning_a_role_moves_every_thread_of_its_processes_and_no_other(monkeypatch):
    monkeypatch.setattr(peer_timing, "ROLES", (ROLE, *peer_timing.ROLES))
    threads = "import threading, time\n[threading.Thread(target=time.sleep, args=(60,)).start() for _ in range(2)]\ntime.sleep(60)"
    server = subprocess.Popen([sys.executable, "-c", threads, ROLE[0]], start_new_session=True)
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], start_new_session=True)
    try:
        target = min(os.sched_getaffinity(0))
        deadline = time.monotonic() + 30
        while len(os.listdir(f"/proc/{server.pid}/task")) < 3 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert peer_timing.pin_tree_role(ROLE[1], {target}) == [server.pid]
        for thread in os.listdir(f"/proc/{server.pid}/task"):
            assert os.sched_getaffinity(int(thread)) == {target}
        assert os.sched_getaffinity(other.pid) == os.sched_getaffinity(0)
    finally:
        for process in (server, other):
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
