"""How much memory a device has free now: what a KV pool sized as a share of it takes from.

On a GPU, the driver's free memory (``cudaMemGetInfo``: after the weights, what the process
and others hold). On a CPU, the memory the kernel says is available (``MemAvailable``),
bounded by what the process's cgroup (a pod's memory limit) still allows.
"""

from __future__ import annotations

from pathlib import Path

import torch

MEMINFO = Path("/proc/meminfo")
CGROUP = Path("/sys/fs/cgroup")  # cgroup v2: memory.max and memory.current


def free_memory_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return free
    available = _meminfo_available()
    room = _cgroup_room()
    return available if room is None else min(available, room)


def _meminfo_available() -> int:
    for line in MEMINFO.read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"{MEMINFO} has no MemAvailable line")


def _cgroup_room() -> int | None:
    """The cgroup's limit less its usage; None without a limit (or without cgroup v2)."""
    try:
        limit = (CGROUP / "memory.max").read_text().strip()
        current = int((CGROUP / "memory.current").read_text())
    except (OSError, ValueError):
        return None
    if limit == "max":
        return None
    return max(0, int(limit) - current)
