"""Where a server's CPU compute may start: one thread per process runs parallel torch work.

libgomp (torch's OpenMP on Linux) gives every thread that starts a parallel region a pool
of worker threads of its own, and keeps the pool until that thread exits. Once a process
holds more OpenMP threads than it has CPUs, libgomp stops spinning between regions (its
"throttled" wait: ~100 spins, then a futex sleep), so every region of an engine step costs
futex wake-ups and scheduler round trips. An engine step is hundreds of short regions: on
the 2-core peer workload, an engine stepped on a second thread after loading its model on
the main thread ran at 2,800-3,100 tokens/s with ~8,500 context switches, against
4,000-5,000 tokens/s and ~30 switches when one thread did both.

A server loads its model on one thread and steps it on another (the main thread waits for
signals). So the loading, which runs parallel copies and conversions, happens on a
short-lived thread whose pool leaves with it: ``build_on_short_lived_thread``. Threads that
only move bytes (gRPC handlers, the KV receiver's memoryview copies) never start a region.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def build_on_short_lived_thread(build: Callable[[], T], name: str = "build") -> T:
    """``build()`` on a thread of its own that exits before this returns (with it, any OpenMP
    pool it started); its result, or its exception raised here."""
    outcome: dict[str, object] = {}

    def run() -> None:
        try:
            outcome["value"] = build()
        except BaseException as e:  # noqa: BLE001 - re-raised in the caller's thread
            outcome["error"] = e

    thread = threading.Thread(target=run, name=name)
    thread.start()
    thread.join()  # unbounded on purpose: the build is the caller's own work (a model load)
    if "error" in outcome:
        raise outcome["error"]  # type: ignore[misc]
    return outcome["value"]  # type: ignore[return-value]
