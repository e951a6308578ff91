"""Waiting on child processes without a tick, for the local cluster's supervisor.

On Linux a process's exit is a file descriptor (``os.pidfd_open``) that turns readable when
the process ends, reaped or not, so one ``poll()`` waits for whichever of several children
ends first, for a ``StopEvent`` (a pipe that a signal handler or another thread writes to)
and for a deadline, all at once. Where there are no pidfds (not Linux) a child's exit cannot
wake the wait: it is re-checked every ``EXIT_RECHECK_S`` instead.
"""

from __future__ import annotations

import os
import select
import subprocess
import time
from collections.abc import Iterable

# Without pidfds (not Linux) nothing wakes a wait when a child exits: this often, it looks.
EXIT_RECHECK_S = 0.5
HAS_PIDFD = hasattr(os, "pidfd_open")


class StopEvent:
    """A ``threading.Event`` that ``wait_for_exits`` wakes on: ``set()`` may be called from a
    signal handler or any thread (it writes a byte to a pipe the wait polls)."""

    def __init__(self) -> None:
        self._read_fd, self._write_fd = os.pipe()
        os.set_blocking(self._read_fd, False)
        os.set_blocking(self._write_fd, False)
        self._set = False

    def set(self) -> None:
        self._set = True
        try:
            os.write(self._write_fd, b"\0")
        except BlockingIOError:  # the pipe is full of earlier wake-ups: it is readable already
            pass

    def is_set(self) -> bool:
        return self._set

    def fileno(self) -> int:
        return self._read_fd

    def close(self) -> None:
        os.close(self._read_fd)
        os.close(self._write_fd)


def wait_for_exits(processes: Iterable[subprocess.Popen], timeout_s: float,
                   stop: StopEvent | None = None) -> None:
    """Return once one of ``processes`` has exited, ``stop`` is set, or ``timeout_s`` has
    passed, whichever comes first (it does not reap: ``poll()`` tells which one ended)."""
    if stop is not None and stop.is_set():
        return
    poller = select.poll()
    if stop is not None:
        poller.register(stop.fileno(), select.POLLIN)
    pidfds: list[int] = []
    try:
        if HAS_PIDFD:
            for process in processes:
                if process.returncode is not None:
                    return  # reaped already: it has exited
                try:
                    pidfds.append(os.pidfd_open(process.pid))
                except ProcessLookupError:  # reaped since (by another thread): it has exited
                    return
                poller.register(pidfds[-1], select.POLLIN)
        else:
            timeout_s = min(timeout_s, EXIT_RECHECK_S)
        poller.poll(max(0.0, timeout_s) * 1000)
    finally:
        for pidfd in pidfds:
            os.close(pidfd)


def wait_for_exit(process: subprocess.Popen, timeout_s: float) -> bool:
    """``process.wait(timeout_s)`` without its polling loop: whether it exited (reaped then)."""
    if not HAS_PIDFD:
        try:
            process.wait(timeout_s)
        except subprocess.TimeoutExpired:
            return False
        return True
    deadline = time.monotonic() + timeout_s
    while process.poll() is None:
        remaining_s = deadline - time.monotonic()
        if remaining_s <= 0:
            return False
        wait_for_exits([process], remaining_s)
    return True
