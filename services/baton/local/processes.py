"""The processes of a local cluster: children that die with the process that started them,
stopped within a bound, their logs' ends, the waits for readiness, and the private
redis-server."""

from __future__ import annotations

import ctypes
import math
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from baton.local.child_exits import wait_for_exit, wait_for_exits
from baton.serving import free_port

STOP_TIMEOUT_S = 10.0  # SIGTERM, then this long, then SIGKILL
PR_SET_PDEATHSIG = 1
# Readiness announces itself nowhere (redis-server tells systemd only; the routing store has
# no watch): it is asked again after a back-off from READY_RETRY_FIRST_S, doubling up to
# READY_RETRY_MAX_S. Between tries the wait ends at once if a child exits.
READY_RETRY_FIRST_S = 0.02
READY_RETRY_MAX_S = 0.5

try:  # resolved here, not in the child: between fork and exec only this C call runs
    _PRCTL = ctypes.CDLL(None, use_errno=True).prctl
except (OSError, AttributeError):  # not Linux: stop() still cleans up on every normal exit
    _PRCTL = None
_SETPRIV = shutil.which("setpriv")  # util-linux: sets the death signal, then execs


def ready_retries_s(deadline: float) -> Iterator[float]:
    """One item per readiness check: the wait after it if it fails, cut to the time left
    before ``deadline``; the last one, 0, is the check at the deadline."""
    wait_s = READY_RETRY_FIRST_S
    while (left_s := deadline - time.monotonic()) > 0:
        yield min(wait_s, left_s)
        wait_s = min(2 * wait_s, READY_RETRY_MAX_S)
    yield 0.0


def _die_with_parent() -> None:
    """preexec_fn fallback: SIGTERM when the process that started the child dies (Linux)."""
    if _PRCTL is not None:
        _PRCTL(PR_SET_PDEATHSIG, signal.SIGTERM)


def popen_dying_with_parent(command: list[str], **kwargs) -> subprocess.Popen:
    """Start a child that gets SIGTERM when this process dies, so that a killed ``baton up``
    or test run leaves no servers behind.

    ``setpriv --pdeathsig`` does it without running Python in the forked child. A
    ``preexec_fn`` is the fallback where setpriv is missing: Python code between fork and
    exec is not safe in a process with threads (a restarted redis-server was once seen
    to die with SIGABRT before it ran)."""
    if _SETPRIV is not None:
        return subprocess.Popen([_SETPRIV, "--pdeathsig", "TERM", "--", *command], **kwargs)
    return subprocess.Popen(command, preexec_fn=_die_with_parent, **kwargs)  # noqa: PLW1509


class ManagedRedis:
    """A ``redis-server`` of our own on a free localhost port, without persistence."""

    def __init__(self, directory: Path) -> None:
        binary = shutil.which("redis-server")
        if binary is None:
            raise ValueError("redis-server is not installed: `make setup` installs it, or give "
                             "a Redis with --redis redis://HOST:PORT/0 (processes cannot share "
                             "the in-memory store)")
        self.port = free_port()
        self.log_path = directory / f"redis-{self.port}.log"
        self.command = [binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
                        "--appendonly", "no", "--dir", str(directory), "--protected-mode", "no"]
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.start()

    def start(self) -> None:
        """(Re)start on the same port: clients reconnect to the same URL, and find it empty."""
        with self.log_path.open("ab") as log:
            self.process = popen_dying_with_parent(self.command, stdout=log, stderr=subprocess.STDOUT)

    def wait_ready(self, timeout_s: float) -> None:
        """Wait for PONG. A server that dies on start is started once more (one restarted on
        the same port was once seen to die with SIGABRT); a second death raises with the end
        of its log."""
        may_restart = True
        for wait_s in ready_retries_s(time.monotonic() + timeout_s):
            if self.process.poll() is not None:
                if may_restart:
                    may_restart = False
                    self.start()
                    continue
                raise RuntimeError(f"redis-server exited with {self.process.returncode} "
                                   f"on port {self.port}; its log ends:\n{self.log_tail()}")
            if self._answers_ping():
                return
            wait_for_exits([self.process], wait_s)  # its death ends the wait at once
        raise TimeoutError(f"redis-server on port {self.port} not ready in {timeout_s:g} s")

    def _answers_ping(self) -> bool:
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=0.5) as conn:
                conn.sendall(b"PING\r\n")
                return conn.recv(16).startswith(b"+PONG")
        except OSError:
            return False

    def stop(self) -> None:
        terminate(self.process)

    def log_tail(self, num_chars: int = 2000) -> str:
        return tail(self.log_path, num_chars)


def tail(path: Path, num_chars: int) -> str:
    """The end of a child's log ("" when there is none yet)."""
    try:
        return path.read_text(errors="replace")[-num_chars:]
    except OSError:
        return ""


def terminate(process: subprocess.Popen) -> None:
    if process.poll() is None:
        process.terminate()
        if not wait_for_exit(process, STOP_TIMEOUT_S):
            process.kill()
            process.wait()


PORT_TAKEN = "address already in use"  # matched in any case: grpc and asyncio differ


@dataclass
class Child:
    name: str
    role: str
    process: subprocess.Popen
    log_path: Path
    args: list[str] = field(default_factory=list)  # the role's own flags, to start it again
    metrics_port: int = 0  # its /metrics (autoscaled clusters only)
    http_port: int = 0  # a decode pod's own OpenAI door (spec.decode_http only)
    log_start: int = 0  # where this start's output begins in the (appended) log
    port_retries: int = 0  # starts again after losing a port to another process

    def log_tail(self, num_chars: int = 3000) -> str:
        return tail(self.log_path, num_chars)

    def lost_a_port(self) -> bool:
        """This start died binding a port another process took since it was picked."""
        with self.log_path.open("rb") as log:
            log.seek(self.log_start)
            return PORT_TAKEN in log.read().decode(errors="replace").lower()


RESTART_BACKOFF_S = 0.5  # the wait before the first restart of a unit
RESTART_BACKOFF_MAX_S = 30.0
RESTART_STABLE_S = 60.0  # up this long: the next death restarts after RESTART_BACKOFF_S again


class RestartBackoff:
    """When a dead unit may start again: its last start plus a back-off that doubles with
    each restart; a unit that stayed up ``RESTART_STABLE_S`` starts over."""

    def __init__(self) -> None:
        self.starts: dict[str, tuple[int, float]] = {}  # unit -> (restarts, last start)

    def due_at(self, unit: str) -> float:
        restarts, last_start = self.starts.get(unit, (0, -math.inf))
        return last_start + min(RESTART_BACKOFF_MAX_S, RESTART_BACKOFF_S * 2 ** restarts)

    def take(self, unit: str, now: float) -> bool:
        """Whether a dead unit may start again now (and if so, count the start)."""
        if now < self.due_at(unit):
            return False
        restarts, last_start = self.starts.get(unit, (0, -math.inf))
        if now - last_start > RESTART_STABLE_S:
            restarts = 0
        self.starts[unit] = (restarts + 1, now)
        return True

    def count(self, unit: str) -> int:
        return self.starts[unit][0]
