"""Waiting on real child processes without a tick: a child's exit, a stop event set from
another thread or a signal handler, and the timeout each end the wait; a wait for one
child's exit reaps it, or says it is still running at the deadline."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading

import pytest
from baton.local.child_exits import StopEvent, wait_for_exit, wait_for_exits

WAIT_S = 60.0  # far beyond what any wait here needs: a wait that does not wake fails the test


def stdin_child() -> subprocess.Popen:
    """A child that runs until its stdin is closed, then exits with the bytes it read."""
    return subprocess.Popen([sys.executable, "-c", "import sys; sys.exit(len(sys.stdin.read()))"],
                            stdin=subprocess.PIPE)


@pytest.fixture
def children():
    started: list[subprocess.Popen] = []

    def start() -> subprocess.Popen:
        started.append(stdin_child())
        return started[-1]

    yield start
    for process in started:
        process.kill()
        process.wait()
        process.stdin.close()


def in_thread(wait) -> threading.Thread:
    thread = threading.Thread(target=wait)
    thread.start()
    return thread


def test_the_wait_ends_when_one_of_the_children_exits(children):
    first, second = children(), children()
    waiter = in_thread(lambda: wait_for_exits([first, second], WAIT_S))
    second.stdin.write(b"abc")
    second.stdin.close()
    waiter.join(WAIT_S / 2)
    assert not waiter.is_alive()
    assert first.poll() is None and second.wait() == 3


def test_a_child_that_exited_before_the_wait_ends_it_at_once(children):
    child = children()
    child.stdin.close()
    child.wait()  # reaped: its pid may not be opened again
    waiter = in_thread(lambda: wait_for_exits([children(), child], WAIT_S))
    waiter.join(WAIT_S / 2)
    assert not waiter.is_alive()


def test_a_stop_set_from_another_thread_ends_the_wait(children):
    stop = StopEvent()
    try:
        waiter = in_thread(lambda: wait_for_exits([children()], WAIT_S, stop))
        stop.set()
        waiter.join(WAIT_S / 2)
        assert not waiter.is_alive() and stop.is_set()
        wait_for_exits([children()], WAIT_S, stop)  # set stays set: returns at once
    finally:
        stop.close()


def test_a_stop_set_by_a_signal_handler_ends_a_wait_in_the_main_thread(children):
    """What `baton up` does on SIGTERM: the handler runs between the retried system calls."""
    stop = StopEvent()
    previous = signal.signal(signal.SIGUSR1, lambda *_: stop.set())
    try:
        threading.Timer(0.0, os.kill, (os.getpid(), signal.SIGUSR1)).start()
        wait_for_exits([children()], WAIT_S, stop)
        assert stop.is_set()
    finally:
        signal.signal(signal.SIGUSR1, previous)
        stop.close()


def test_wait_for_exit_reaps_the_child_or_says_it_still_runs(children):
    child = children()
    assert wait_for_exit(child, 1.0) is False and child.returncode is None
    child.stdin.close()
    assert wait_for_exit(child, WAIT_S) is True and child.returncode == 0
