"""The decode pod's watch on its own engine loop: a step that never returns.

A stuck step (a hung GPU kernel or collective, a deadlock in a library) leaves the process
alive and its gRPC server answering, so neither the channels' keepalive pings nor the
routing TTL notice it, and every stream on the pod would wait forever. The watchdog, a
thread of its own, wakes when the running step would pass ``stall_s`` (between steps,
``stall_s`` on: the soonest a step not yet begun could); once a step has run longer than
``stall_s`` it fails every stream UNAVAILABLE (``EngineStalled``: the gateway moves them to
another pod, replaying what they had) without touching the engine, and calls
``on_stalled``: the server then leaves routing and exits, for its supervisor (Kubernetes,
``baton up``) to start it again. A stuck thread cannot be stopped from inside the process.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from baton.decode.worker import DecodeWorker

log = logging.getLogger(__name__)


class EngineWatchdog:
    def __init__(self, worker: DecodeWorker, stall_s: float, on_stalled: Callable[[], None]) -> None:
        self.worker = worker
        self.stall_s = stall_s
        self.on_stalled = on_stalled
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="engine-watchdog", daemon=True)

    def start(self) -> EngineWatchdog:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stopping.set()
        self._thread.join()

    def _watch(self) -> None:
        # The engine loop does not announce its steps, so each wait ends at a deadline: the
        # running step's stall, or (between steps) the soonest one could stall. A step seen
        # still running at its deadline has stalled; one that returned leaves nothing to do.
        while not self._stopping.wait(max(0.0, self.stall_s - self.worker.step_running_s())):
            running_s = self.worker.step_running_s()
            if running_s > self.stall_s:
                log.critical("the engine's step has run for %.1f s (scheduler.step_stall_s %g): "
                             "failing its streams and leaving", running_s, self.stall_s)
                self.worker.fail_stalled(f"the decode engine made no progress for {running_s:.0f} s "
                                         f"(scheduler.step_stall_s {self.stall_s:g}); the pod is "
                                         f"restarting")
                self.on_stalled()
                return
