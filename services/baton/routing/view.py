"""``RoutingView``: the gateway's picture of the workers, which survives a store outage.

The gateway asks ``snapshot()`` on every routing decision. The view re-reads the store at
most every ``refresh_s``; when the store is unreachable it keeps answering from the last
good read (marked ``stale``) and retries on the next refresh, so losing Redis never stops
routing, and workers that appeared meanwhile show up on the first read after it is back.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from baton.routing.prefix_index import PrefixIndex
from baton.routing.store import RoutingStore, StoreUnavailable, WorkerInfo

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RoutingSnapshot:
    workers: tuple[WorkerInfo, ...]
    read_at: float  # clock time of the store read these workers come from (0 = never read)
    stale: bool  # the latest attempt to re-read failed
    prefixes: PrefixIndex | None = None  # what the decode pods' prefix caches hold (live object)

    def of_role(self, role: str) -> list[WorkerInfo]:
        return [worker for worker in self.workers if worker.role == role]


FRESH_READ_MIN_S = 0.05  # a view this young is not re-read even when a caller asks
FRESH_READ_WAIT_S = 1.0  # how long a caller that asks waits for a read in progress


class RoutingView:
    def __init__(self, store: RoutingStore, refresh_s: float,
                 clock: Callable[[], float] = time.monotonic,
                 prefixes: PrefixIndex | None = None) -> None:
        """``prefixes``: an index of the decode pods' prefix caches, refreshed with the workers."""
        if refresh_s < 0:
            raise ValueError(f"routing view refresh_s must be >= 0, got {refresh_s}")
        self.store = store
        self.refresh_s = refresh_s
        self._clock = clock
        self.prefixes = prefixes
        self._snapshot = RoutingSnapshot(workers=(), read_at=0.0, stale=True, prefixes=prefixes)
        self._last_attempt = -float("inf")
        self._refreshing = threading.Lock()

    def snapshot(self, fresh: bool = False) -> RoutingSnapshot:
        """The current view; re-reads the store when the last attempt is older than refresh_s.

        Concurrent callers never queue behind a slow store: while one thread re-reads, the
        others get the previous snapshot. ``fresh``: the caller found the view lacking (no
        live decode worker, as right after start-up, before the first refresh has seen the
        pods): re-read unless a read is under ``FRESH_READ_MIN_S`` old, waiting at most
        ``FRESH_READ_WAIT_S`` for a read in progress.
        """
        age_s = self._clock() - self._last_attempt
        if fresh:
            due = age_s >= min(self.refresh_s, FRESH_READ_MIN_S)
            acquired = self._refreshing.acquire(timeout=FRESH_READ_WAIT_S)
            if acquired and not due:  # a read just started or ended: its result is what we want
                self._refreshing.release()
                return self._snapshot
        else:
            acquired = age_s >= self.refresh_s and self._refreshing.acquire(blocking=False)
        if acquired:
            try:
                self._refresh()
            finally:
                self._refreshing.release()
        return self._snapshot

    def _refresh(self) -> None:
        self._last_attempt = self._clock()
        try:
            workers = tuple(self.store.list_workers())
        except StoreUnavailable as e:
            if not self._snapshot.stale:
                log.warning("routing from the last view of %d workers: %s",
                            len(self._snapshot.workers), e)
            self._snapshot = RoutingSnapshot(self._snapshot.workers, self._snapshot.read_at,
                                             stale=True, prefixes=self.prefixes)
            return
        if self._snapshot.stale and self._snapshot.read_at:
            log.info("routing store is back: %d workers", len(workers))
        self._snapshot = RoutingSnapshot(workers, read_at=self._last_attempt, stale=False,
                                         prefixes=self.prefixes)
        if self.prefixes is not None:
            try:
                self.prefixes.refresh(self.store, [w for w in workers if w.role == "decode"])
            except StoreUnavailable as e:  # the workers were read: route on the index as it is
                log.warning("prefix-cache index not refreshed: %s", e)
            except (ValueError, KeyError, TypeError):  # a record this release cannot read
                log.exception("prefix-cache index not refreshed (routing goes on without it)")
