"""``Heartbeat``: a worker's background thread that keeps its routing record alive.

Every ``interval_s`` it writes the worker's current record (``describe()`` is called each
time, so the load is live) with a TTL; if the worker dies the record expires by itself. A
store outage is logged once and retried every beat: the worker keeps serving, and its record
comes back on the first beat after the store does. ``stop()`` removes the record so a clean
shutdown leaves routing at once.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Self

from baton.routing.store import RoutingStore, StoreUnavailable, WorkerInfo

log = logging.getLogger(__name__)


class Heartbeat:
    def __init__(self, store: RoutingStore, describe: Callable[[], WorkerInfo],
                 interval_s: float, ttl_s: float) -> None:
        if not 0 < interval_s < ttl_s:
            raise ValueError(f"heartbeat interval_s {interval_s} must be > 0 and below "
                             f"ttl_s {ttl_s}")
        self.store = store
        self.describe = describe
        self.interval_s = interval_s
        self.ttl_s = ttl_s
        self.beats = 0  # successful writes, for tests and metrics
        self._store_reachable = True  # log an outage when it starts, not on every beat
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None
        self._worker_id = ""

    def start(self) -> Self:
        """Register now (so routing sees the worker before start returns), then keep beating."""
        self.beat()
        self._thread = threading.Thread(target=self._run, name="routing-heartbeat", daemon=True)
        self._thread.start()
        return self

    def beat(self) -> bool:
        """Write the record once; False when the store is unreachable."""
        worker = self.describe()
        self._worker_id = worker.worker_id
        try:
            self.store.register_worker(worker, self.ttl_s)
        except StoreUnavailable as e:
            if self._store_reachable:
                log.warning("heartbeats of %s failing: %s", worker.worker_id, e)
            self._store_reachable = False
            return False
        if not self._store_reachable:
            log.info("heartbeats of %s reach the routing store again", worker.worker_id)
        self._store_reachable = True
        self.beats += 1
        return True

    def _run(self) -> None:
        while not self._stopping.wait(self.interval_s):
            self.beat()

    def stop(self, deregister: bool = True) -> None:
        """Stop beating; with ``deregister`` the record goes now rather than after its TTL."""
        self._stopping.set()
        if self._thread is not None:
            self._thread.join()
        if deregister and self._worker_id:
            try:
                self.store.remove_worker(self._worker_id)
            except StoreUnavailable as e:
                log.warning("could not deregister %s (it expires by TTL): %s", self._worker_id, e)

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()
