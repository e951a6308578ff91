"""``InMemoryStore``: the routing store of a single process (``baton`` run locally, tests).

A dict of (expiry, record) under one lock; an entry past its expiry is treated as absent
and swept on the next write, so TTLs behave as they do in Redis.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from baton.routing.store import (
    MAX_PREFIX_EVENTS,
    PrefixEvent,
    RequestRecord,
    RoutingStore,
    WorkerInfo,
    check_ttl,
)


class InMemoryStore(RoutingStore):
    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._lock = threading.Lock()
        self._workers: dict[str, tuple[float, WorkerInfo]] = {}
        self._requests: dict[str, tuple[float, RequestRecord]] = {}
        self._prefix_events: dict[str, tuple[float, list[PrefixEvent]]] = {}
        self._prefix_snapshots: dict[str, tuple[float, tuple[int, list[str]]]] = {}

    def _sweep(self, now: float) -> None:
        for table in (self._workers, self._requests, self._prefix_events, self._prefix_snapshots):
            for key in [key for key, (expiry, _) in table.items() if expiry <= now]:
                del table[key]

    def register_worker(self, worker: WorkerInfo, ttl_s: float) -> None:
        check_ttl(ttl_s)
        with self._lock:
            now = self._clock()
            self._sweep(now)
            self._workers[worker.worker_id] = (now + ttl_s, worker)

    def remove_worker(self, worker_id: str) -> None:
        with self._lock:
            self._workers.pop(worker_id, None)

    def list_workers(self, role: str | None = None) -> list[WorkerInfo]:
        with self._lock:
            now = self._clock()
            live = [worker for expiry, worker in self._workers.values()
                    if expiry > now and (role is None or worker.role == role)]
        return sorted(live, key=lambda worker: worker.worker_id)

    def put_request(self, record: RequestRecord, ttl_s: float, if_absent: bool = False) -> bool:
        check_ttl(ttl_s)
        with self._lock:
            now = self._clock()
            self._sweep(now)
            if if_absent and record.request_id in self._requests:
                return False
            self._requests[record.request_id] = (now + ttl_s, record)
            return True

    def get_request(self, request_id: str) -> RequestRecord | None:
        with self._lock:
            expiry, record = self._requests.get(request_id, (0.0, None))
            return record if expiry > self._clock() else None

    def remove_request(self, request_id: str) -> None:
        with self._lock:
            self._requests.pop(request_id, None)

    def append_prefix_events(self, stream: str, events: list[PrefixEvent], ttl_s: float) -> None:
        check_ttl(ttl_s)
        with self._lock:
            now = self._clock()
            self._sweep(now)
            _, held = self._prefix_events.get(stream, (0.0, []))
            held = (held + list(events))[-MAX_PREFIX_EVENTS:]
            self._prefix_events[stream] = (now + ttl_s, held)

    def read_prefix_events(self, stream: str, after: int, limit: int) -> list[PrefixEvent]:
        with self._lock:
            expiry, held = self._prefix_events.get(stream, (0.0, []))
            if expiry <= self._clock():
                return []
            return [event for event in held if event[0] > after][:limit]

    def put_prefix_snapshot(self, stream: str, upto: int, hashes: list[str], ttl_s: float) -> None:
        check_ttl(ttl_s)
        with self._lock:
            now = self._clock()
            self._sweep(now)
            self._prefix_snapshots[stream] = (now + ttl_s, (upto, list(hashes)))

    def get_prefix_snapshot(self, stream: str) -> tuple[int, list[str]] | None:
        with self._lock:
            expiry, snapshot = self._prefix_snapshots.get(stream, (0.0, None))
            return snapshot if expiry > self._clock() else None
