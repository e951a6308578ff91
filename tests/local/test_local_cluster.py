"""The local cluster's supervisor waits on its children, not on a clock: a child's exit, a
retiring pod's exit or kill deadline, a dead unit's restart back-off and a stop end
``wait_for_change``; ``supervise`` then restarts what is due. Cheap real processes stand in
for the pods (a Python child that exits when its stdin closes) and a real redis-server
for the store; the cluster with real pods is in tests/e2e (test_chaos, test_autoscale)."""

from __future__ import annotations

import subprocess
import sys
import threading
import time

import pytest
from baton.local.child_exits import StopEvent
from baton.local.cluster import (
    START_PORT_RETRIES,
    STOP_TIMEOUT_S,
    Child,
    LocalCluster,
    ManagedRedis,
)
from baton.local.spec import ClusterSpec
from redis_server import redis_server_binary

WAIT_S = 60.0  # far beyond what any wait here needs: a wait that does not wake fails the test


@pytest.fixture
def cluster(tmp_path):
    cluster = LocalCluster(ClusterSpec(chain_ranks=0, mtls=False, decode_grace_s=1.0),
                           log_dir=tmp_path)
    yield cluster
    for child in [*cluster.children, *(child for child, _ in cluster.retiring)]:
        if child.process.stdin is not None:  # a stand-in (a restarted pod is a real one)
            child.process.stdin.close()
    cluster.stop()


def add_child(cluster: LocalCluster, name: str) -> Child:
    """A stand-in pod: runs until its stdin is closed, then exits with the bytes it read."""
    process = subprocess.Popen([sys.executable, "-c", "import sys; sys.exit(len(sys.stdin.read()))"],
                               stdin=subprocess.PIPE)
    child = Child(name, "decode", process, cluster.log_dir / f"{name}.log")
    cluster.children.append(child)
    return child


def end(child: Child, num_bytes: int = 0) -> None:
    child.process.stdin.write(b"x" * num_bytes)
    child.process.stdin.close()


def waiting(cluster: LocalCluster, stop: StopEvent | None = None) -> threading.Thread:
    thread = threading.Thread(target=cluster.wait_for_change, args=(WAIT_S, stop))
    thread.start()
    return thread


def test_the_wait_ends_when_a_child_exits_and_supervise_restarts_it(cluster):
    add_child(cluster, "decode-0")
    dying = add_child(cluster, "decode-1")
    waiter = waiting(cluster)
    end(dying, 3)
    waiter.join(WAIT_S / 2)
    assert not waiter.is_alive()
    restarted = f"decode-1 exited with 3; restarted (log {dying.log_path}), restart 1"
    assert cluster.supervise() == [restarted]
    assert cluster.child("decode-1").process.pid != dying.process.pid


def test_a_dead_unit_in_its_back_off_does_not_end_the_wait_but_a_stop_does(cluster):
    child = add_child(cluster, "decode-0")
    end(child)
    child.process.wait()
    cluster._restarts.starts["decode-0"] = (5, time.monotonic())  # next start 16 s after the last
    stop = StopEvent()
    try:
        waiter = waiting(cluster, stop)
        waiter.join(2.0)
        assert waiter.is_alive(), "the wait ended with nothing due"
        assert cluster.supervise() == []
        stop.set()
        waiter.join(WAIT_S / 2)
        assert not waiter.is_alive()
    finally:
        stop.set()
        stop.close()


def test_a_retired_pod_ends_the_wait_when_it_exits_and_is_killed_past_its_deadline(cluster):
    drained, stuck = add_child(cluster, "decode-0"), add_child(cluster, "decode-1")
    cluster.children.clear()
    cluster.retiring = [(drained, time.monotonic() + WAIT_S), (stuck, time.monotonic() + WAIT_S)]
    waiter = waiting(cluster)
    end(drained)
    waiter.join(WAIT_S / 2)
    assert not waiter.is_alive()
    assert cluster.supervise() == ["decode-0 drained and exited (0)"]
    cluster.retiring = [(stuck, time.monotonic() - 1.0)]  # past its deadline: due at once
    cluster.wait_for_change(WAIT_S)
    killed = f"decode-1 did not exit within {1.0 + STOP_TIMEOUT_S:g} s of SIGTERM: killed"
    assert cluster.supervise() == [killed]
    assert stuck.process.returncode is not None and cluster.retiring == []


@pytest.mark.skipif(redis_server_binary() is None, reason="needs redis-server")
def test_a_killed_redis_server_is_restarted_after_each_back_off(cluster, tmp_path):
    cluster.redis = ManagedRedis(tmp_path)
    cluster.redis.wait_ready(WAIT_S)
    for attempt in (1, 2):  # the second waits out a 1 s back-off
        cluster.redis.process.kill()
        wakes = 0
        events: list[str] = []
        while not events:
            cluster.wait_for_change(WAIT_S)
            wakes += 1
            events = cluster.supervise()
        assert wakes <= 3, "the wait woke with nothing to do"
        port = cluster.redis.port
        assert events == [f"redis-server exited with -9; restarted on port {port}, restart {attempt}"]
        cluster.redis.wait_ready(WAIT_S)


@pytest.mark.parametrize("message", [  # as gRPC's server says it, and as asyncio's (the HTTP door)
    "OSError: [Errno 98] Address already in use",
    ("OSError: [Errno 98] error while attempting to bind on address ('127.0.0.1', 55313): "
     "address already in use")])
def test_a_child_that_lost_its_port_at_start_starts_again_and_other_deaths_are_reported(
        cluster, monkeypatch, message):
    spawned = []

    def spawn(name, role, args):  # a stand-in for a real start
        spawned.append((name, role, args))
        return add_child(cluster, name)

    monkeypatch.setattr(cluster, "_spawn", spawn)
    lost, crashed = add_child(cluster, "decode-0"), add_child(cluster, "decode-1")
    lost.args = ["--flag"]
    lost.log_path.write_text(f"earlier start: {message}\n")
    crashed.log_path.write_text("earlier start: OSError: [Errno 98] Address already in use\n")
    crashed.log_start = crashed.log_path.stat().st_size  # that was an earlier start's death
    with crashed.log_path.open("a") as log:
        log.write("ValueError: something else\n")
    end(lost)
    end(crashed)
    lost.process.wait(WAIT_S)
    crashed.process.wait(WAIT_S)
    cluster._start_again_after_lost_ports()
    assert spawned == [("decode-0", "decode", ["--flag"])]
    again = cluster.children[-1]
    assert again.name == "decode-0" and again.port_retries == 1 and lost not in cluster.children
    with pytest.raises(RuntimeError, match="decode-1 exited"):
        cluster.check_alive()
    # A child that keeps losing its ports is reported after START_PORT_RETRIES starts.
    again.port_retries = START_PORT_RETRIES
    end(again)
    again.process.wait(WAIT_S)
    cluster.children.remove(crashed)
    cluster._start_again_after_lost_ports()
    assert len(spawned) == 1
    with pytest.raises(RuntimeError, match="decode-0 exited"):
        cluster.check_alive()
