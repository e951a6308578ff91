"""Timing helpers shared by both sides of the peer benchmark (standard library only: the
vLLM side runs in its own virtualenv, without baton).

A run waits for a quiet machine before it starts, and reports how much CPU time other
processes used while it was timed: busy time of the whole machine (``/proc/stat``) minus
the run's own (``resource.getrusage``, all its threads).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Self

QUIET_CORES = 0.15  # busy cores (over one second) below which the machine counts as quiet
QUIET_WAIT_S = 120.0


def _busy_s() -> float:
    """CPU seconds the whole machine has spent busy since boot (all cores)."""
    with open("/proc/stat") as stat:
        fields = [int(x) for x in stat.readline().split()[1:]]
    idle = fields[3] + fields[4]  # idle + iowait
    return (sum(fields[:8]) - idle) / os.sysconf("SC_CLK_TCK")


def _process_table() -> dict[int, tuple[int, float]]:
    """pid -> (parent pid, CPU seconds so far) of every live process."""
    table = {}
    tick = os.sysconf("SC_CLK_TCK")
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as stat:
                fields = stat.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        table[int(entry)] = (int(fields[1]), (int(fields[11]) + int(fields[12])) / tick)
    return table


def _own_tree(table: dict[int, tuple[int, float]]) -> set[int]:
    """This process and its live descendants."""
    tree, frontier = set(), {os.getpid()}
    while frontier:
        tree |= frontier
        frontier = {pid for pid, (parent, _) in table.items() if parent in frontier} - tree
    return tree


def _exited_children_s() -> float:
    exited = resource.getrusage(resource.RUSAGE_CHILDREN)
    return exited.ru_utime + exited.ru_stime


def _own_cpu_s() -> float:
    """CPU seconds of this process and every live descendant (vLLM runs its engine in
    child processes), plus the children that have already exited."""
    table = _process_table()
    return sum(table[pid][1] for pid in _own_tree(table) if pid in table) + _exited_children_s()


# What a process of the tree is, by a piece of its command line (the first that matches).
ROLES = (("baton.cli gateway", "gateway"), ("baton.cli decode", "decode pod"),
         ("baton.cli prefill", "prefill chain"), ("redis-server", "redis"),
         ("EngineCore", "vLLM engine core"),
         ("vllm.entrypoints.openai.api_server", "vLLM API server"),
         ("APIServer", "vLLM API server"))


def _command_line(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as cmdline:
            return cmdline.read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def _named_role(pid: int) -> str | None:
    """The role (``ROLES``) a process's command line names, if any."""
    line = _command_line(pid)
    return next((name for pattern, name in ROLES if pattern in line), None)


def pin_tree_role(role: str, cpus: set[int]) -> list[int]:
    """Move every thread of this process tree's processes of ``role`` (``ROLES``) onto
    ``cpus``; returns their pids."""
    pids = [pid for pid in _own_tree(_process_table()) if _named_role(pid) == role]
    for pid in pids:
        for thread in os.listdir(f"/proc/{pid}/task"):
            os.sched_setaffinity(int(thread), cpus)
    return pids


def _cpu_by_role(own_role: str) -> dict[str, float]:
    """CPU seconds so far of this process's tree, summed by role (``ROLES``). A process whose
    command line names none takes its parent's (a chain's ranks, multiprocessing's helpers);
    this process and its exited children are ``own_role``."""
    table = _process_table()
    tree = _own_tree(table)
    roles: dict[int, str] = {os.getpid(): own_role}

    def role(pid: int) -> str:
        if pid not in roles:  # the tree's root is in ``roles``: every parent here is in the tree
            roles[pid] = _named_role(pid) or role(table[pid][0])
        return roles[pid]

    totals = {own_role: _exited_children_s()}
    for pid in tree:
        totals[role(pid)] = totals.get(role(pid), 0.0) + table[pid][1]
    return totals


def wait_for_quiet(limit: float = QUIET_CORES, timeout_s: float = QUIET_WAIT_S) -> float:
    """Wait (bounded) until the machine's busy time over one second, this process's own
    excluded, stays below ``limit`` cores; returns the last such reading. (The load
    average would lag a minute behind the previous run.)"""
    deadline = time.monotonic() + timeout_s
    while True:
        busy, own = _busy_s(), _own_cpu_s()
        time.sleep(1.0)
        cores = max(0.0, (_busy_s() - busy) - (_own_cpu_s() - own))
        if cores < limit or time.monotonic() >= deadline:
            return cores


@dataclass
class CpuWindow:
    """Wall time, own CPU time and other processes' CPU time of a timed part, and the own
    part by role (``by_role``: the client, a server's processes; ``own_role`` names this
    process). /proc counts in clock ticks (10 ms): a role's figure is good to a few ticks."""

    own_role: str = "this process"
    wall_s: float = 0.0
    own_cpu_s: float = 0.0
    others_cpu_s: float = 0.0
    by_role: dict[str, float] = field(default_factory=dict)

    def __enter__(self) -> Self:
        self._wall = time.perf_counter()
        self._busy = _busy_s()
        self._roles = _cpu_by_role(self.own_role)
        return self

    def __exit__(self, *exc) -> None:
        self.wall_s = time.perf_counter() - self._wall
        roles = _cpu_by_role(self.own_role)
        # Rounded to getrusage's microseconds: a role with no ticks in the window reads 0, not
        # the float noise of two equal sums subtracted (which made the total read below a role).
        self.by_role = {role: round(seconds - self._roles.get(role, 0.0), 6)
                        for role, seconds in roles.items()}
        self.own_cpu_s = round(sum(self.by_role.values()), 6)  # the roles cover the whole tree
        self.others_cpu_s = max(0.0, _busy_s() - self._busy - self.own_cpu_s)


def run_arguments() -> argparse.Namespace:
    """The command line of both offline runners: MODEL_DIR WORKLOAD_JSON OUT_JSON --dtype D
    [--threads N] [--token-budget N] [--max-seqs N]."""
    parser = argparse.ArgumentParser()
    parser.add_argument("model")
    parser.add_argument("workload")
    parser.add_argument("out")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--token-budget", type=int, default=0,
                        help="tokens per engine step (0: the system's default)")
    parser.add_argument("--max-seqs", type=int, default=0,
                        help="most sequences running at once (0: the system's default)")
    parser.add_argument("--no-prefix-cache", action="store_true",
                        help="turn the system's prefix cache off (both have it on by default)")
    return parser.parse_args()


def write_result(out: str, system: str, dtype: str, load_s: float, window: CpuWindow,
                 first_token_s: list[float], token_ids: list[list[int]], **extra) -> None:
    """One run's JSON result, the same for both systems (requests in workload order)."""
    result = {"system": system, "dtype": dtype, "load_s": load_s, **extra,
              "wall_s": window.wall_s, "own_cpu_s": window.own_cpu_s,
              "others_cpu_s": window.others_cpu_s,
              "generated_tokens": sum(len(ids) for ids in token_ids),
              "ttft_s": first_token_s, "token_ids": token_ids}
    Path(out).write_text(json.dumps(result))
