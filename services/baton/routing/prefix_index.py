"""What each decode pod's prefix cache holds, published by the pod and read by gateways.

Pod side, ``PrefixPublisher``: the engine thread hands over its cache's events
(``offer``); a thread of the publisher's own writes them to the routing store as soon as
they come (it waits on an event, not a clock), a snapshot of every hash held every
``snapshot_every`` events, and refreshes both before they expire while nothing happens.

Gateway side, ``PrefixIndex``: per decode pod process (``WorkerInfo.prefix_stream``) the set
of block hashes it holds, brought up to date from the store on every routing-view refresh:
the events after the last one applied; after a gap (the gateway fell behind the store's
bound, or just started) the pod's snapshot, then the events after it. Every gateway replica
reads the same store, so they all see the same index. ``matched_blocks`` tells a routing
policy how many of a prompt's leading blocks a pod holds.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable, Sequence

from baton.kv.prefix_cache import cache_root, extend_block_hashes
from baton.routing.store import PrefixEvent, RoutingStore, StoreUnavailable, WorkerInfo

log = logging.getLogger(__name__)

SNAPSHOT_EVERY = 1024  # events between two snapshots (well under the store's bound)
EXPECT_S = 30.0  # how long a routed prompt's blocks count as held before the pod's events say so
READ_LIMIT = 8192  # events read per store call


class PrefixPublisher:
    def __init__(self, store: RoutingStore, stream: str, ttl_s: float,
                 snapshot_every: int = SNAPSHOT_EVERY) -> None:
        self.store = store
        self.stream = stream
        self.ttl_s = ttl_s
        self.snapshot_every = snapshot_every
        self._lock = threading.Lock()
        self._pending: list[PrefixEvent] = []
        self._resync: tuple[int, list[str]] | None = None
        self._wake = threading.Event()
        self._stopping = threading.Event()
        self._held: set[str] = set()  # what the store's snapshot + events say the pod holds
        self._published = 0  # the last event number written
        self._since_snapshot = 0
        self._thread = threading.Thread(target=self._run, name="prefix-publisher", daemon=True)

    def start(self) -> PrefixPublisher:
        self._thread.start()
        return self

    def offer(self, events: Iterable[PrefixEvent]) -> None:
        """New events, in order (any thread; never blocks on the store)."""
        with self._lock:
            self._pending.extend(events)
        self._wake.set()

    def offer_snapshot(self, upto: int, hashes: list[str]) -> None:
        """Everything the cache holds after event ``upto`` (when the caller lost events)."""
        with self._lock:
            self._pending = [event for event in self._pending if event[0] > upto]
            self._resync = (upto, hashes)
        self._wake.set()

    def stop(self) -> None:
        self._stopping.set()
        self._wake.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5.0)

    def _run(self) -> None:
        while not self._stopping.is_set():
            self._wake.wait(timeout=self.ttl_s / 3)  # a timeout only to refresh the expiry
            self._wake.clear()
            try:
                self._flush()
            except StoreUnavailable as e:
                log.warning("prefix-cache events not published (kept for the next try): %s", e)
                self._stopping.wait(min(1.0, self.ttl_s / 3))

    def _flush(self) -> None:
        with self._lock:
            events, resync = self._pending, self._resync
            self._pending, self._resync = [], None
        try:
            if resync is not None:
                self._held = set(resync[1])
                self._published = resync[0]
                self.store.put_prefix_snapshot(self.stream, resync[0], resync[1], self.ttl_s)
                self._since_snapshot = 0
            if events:
                self.store.append_prefix_events(self.stream, events, self.ttl_s)
                for number, stored, block_hash in events:
                    (self._held.add if stored else self._held.discard)(block_hash)
                self._published = events[-1][0]
                self._since_snapshot += len(events)
            if self._since_snapshot >= self.snapshot_every or not events:
                # every so often, and whenever idle: keeps the snapshot (and so the pod's
                # entry in every index) from expiring while the cache holds blocks
                self.store.put_prefix_snapshot(self.stream, self._published, sorted(self._held),
                                               self.ttl_s)
                self.store.append_prefix_events(self.stream, [], self.ttl_s)
                self._since_snapshot = 0
        except StoreUnavailable:
            with self._lock:  # back to the front, in order
                self._pending = events + self._pending
                if resync is not None and self._resync is None:
                    self._resync = resync
            raise


class PrefixIndex:
    """The gateway's index of the decode pods' prefix caches (thread-safe)."""

    def __init__(self, clock: Callable[[], float] = time.time) -> None:
        self._clock = clock
        self._lock = threading.Lock()
        self._held: dict[str, set[str]] = {}  # prefix stream -> hashes held
        self._applied: dict[str, int] = {}  # prefix stream -> the last event number applied
        # prefix stream -> hashes expected there (a prompt routed to it), until when
        self._expected: dict[str, dict[str, float]] = {}
        self.resyncs = 0  # snapshots read (a new pod, or events missed)
        self.last_refresh_s = 0.0  # wall-clock time of the last full refresh

    def refresh(self, store: RoutingStore, workers: Sequence[WorkerInfo]) -> None:
        """Bring the index up to date for these decode pods (others are forgotten). Raises
        StoreUnavailable (the caller keeps routing on the index as it is)."""
        streams = {worker.prefix_stream for worker in workers if worker.kv_block_size}
        with self._lock:
            for gone in set(self._held) - streams:
                del self._held[gone]
                del self._applied[gone]
            now = self._clock()
            for stream in list(self._expected):
                expected = {h: until for h, until in self._expected[stream].items()
                            if until > now and h not in self._held.get(stream, ())}
                if expected and stream in streams:
                    self._expected[stream] = expected
                else:
                    del self._expected[stream]
        for stream in streams:
            self._refresh_stream(store, stream)
        self.last_refresh_s = self._clock()

    def _refresh_stream(self, store: RoutingStore, stream: str) -> None:
        applied = self._applied.get(stream)
        events = store.read_prefix_events(stream, applied or 0, READ_LIMIT)
        if applied is None or (events and events[0][0] > applied + 1):
            snapshot = store.get_prefix_snapshot(stream)
            upto, hashes = snapshot if snapshot is not None else (0, [])
            held = set(hashes)
            if not events or events[0][0] > upto + 1:
                events = store.read_prefix_events(stream, upto, READ_LIMIT)
            events = [event for event in events if event[0] > upto]
            self.resyncs += 1
            with self._lock:
                self._held[stream], self._applied[stream] = held, upto
        with self._lock:
            held = self._held[stream]
            for number, stored, block_hash in events:
                (held.add if stored else held.discard)(block_hash)
                self._applied[stream] = number

    def expect(self, worker: WorkerInfo, hashes: Sequence[str]) -> None:
        """A prompt with these block hashes was just routed to the pod: count them as held for
        ``EXPECT_S`` unless its events say so sooner (they come after its prefill)."""
        until = self._clock() + EXPECT_S
        with self._lock:
            expected = self._expected.setdefault(worker.prefix_stream, {})
            for block_hash in hashes:
                expected[block_hash] = until

    def matched_blocks(self, worker: WorkerInfo, hashes: Sequence[str]) -> int:
        """How many leading blocks of ``hashes`` the pod's cache holds, as far as the index knows
        (its events, and the prompts just routed to it)."""
        now = self._clock()
        with self._lock:
            held = self._held.get(worker.prefix_stream, set())
            expected = self._expected.get(worker.prefix_stream, {})
            count = 0
            for block_hash in hashes:
                if block_hash not in held and expected.get(block_hash, 0.0) <= now:
                    break
                count += 1
            return count

    def num_blocks(self, worker: WorkerInfo) -> int:
        with self._lock:
            return len(self._held.get(worker.prefix_stream, ()))


def prompt_hashes(worker: WorkerInfo, prompt_ids: Sequence[int], salt: str) -> list[str]:
    """The hashes a decode pod gives the prompt's full blocks (its block size, model revision
    and KV dtype; the caller's tenant salt), in hex as published."""
    if not worker.kv_block_size:
        return []
    root = cache_root(worker.model_revision, worker.kv_dtype, salt)
    return [h.hex() for h in extend_block_hashes([], prompt_ids, worker.kv_block_size, root)]
