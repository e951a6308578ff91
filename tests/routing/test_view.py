"""The gateway's routing view: refresh pacing, and routing on through a real Redis outage."""

from __future__ import annotations

import time

from baton.routing import Heartbeat, InMemoryStore, RoutingView, StoreUnavailable
from baton.routing.redis_store import RedisStore
from test_store import wait_until, worker


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_view_rereads_at_most_every_refresh_s():
    store, clock = InMemoryStore(), Clock()
    view = RoutingView(store, refresh_s=1.0, clock=clock)
    store.register_worker(worker("d1"), ttl_s=1e9)
    assert [w.worker_id for w in view.snapshot().workers] == ["d1"]
    store.register_worker(worker("d2"), ttl_s=1e9)
    clock.now += 0.5
    assert len(view.snapshot().workers) == 1, "within refresh_s the last read stands"
    clock.now += 0.5
    snapshot = view.snapshot()
    assert [w.worker_id for w in snapshot.workers] == ["d1", "d2"]
    assert snapshot.read_at == clock.now and not snapshot.stale


class FlakyStore(InMemoryStore):
    """An in-memory store that can be switched off, to test the view without timing."""

    down = False

    def list_workers(self, role=None):
        if self.down:
            raise StoreUnavailable("switched off")
        return super().list_workers(role)


def test_view_keeps_the_last_read_while_the_store_is_down():
    store, clock = FlakyStore(), Clock()
    view = RoutingView(store, refresh_s=0.0, clock=clock)
    store.register_worker(worker("d1"), ttl_s=1e9)
    first = view.snapshot()
    store.down = True
    clock.now += 5
    during = view.snapshot()
    assert during.workers == first.workers and during.stale and during.read_at == first.read_at
    assert during.of_role("decode") == list(first.workers)
    store.down = False
    store.register_worker(worker("d2"), ttl_s=1e9)
    after = view.snapshot()
    assert [w.worker_id for w in after.workers] == ["d1", "d2"] and not after.stale


def test_routing_survives_a_real_redis_restart(redis_server):
    """Redis stops (losing everything) and comes back: the gateway's view never goes empty,
    and workers re-register by heartbeat and new ones appear."""
    worker_store = RedisStore(redis_server.url, timeout_s=0.3)
    gateway_store = RedisStore(redis_server.url, timeout_s=0.3)
    view = RoutingView(gateway_store, refresh_s=0.0)
    heartbeat = Heartbeat(worker_store, lambda: worker("d1"), interval_s=0.1, ttl_s=2.0).start()
    try:
        assert [w.worker_id for w in view.snapshot().workers] == ["d1"]

        redis_server.stop()
        started = time.monotonic()
        during = view.snapshot()
        assert during.stale and [w.worker_id for w in during.workers] == ["d1"]
        assert time.monotonic() - started < 3, "a down Redis must not stall routing"
        assert [w.worker_id for w in view.snapshot().workers] == ["d1"]

        redis_server.start()  # same port, empty: everything was lost
        worker_store.register_worker(worker("d2"), ttl_s=30)  # a worker that started meanwhile
        assert wait_until(lambda: [w.worker_id for w in view.snapshot().workers] == ["d1", "d2"])
        assert not view.snapshot().stale
    finally:
        heartbeat.stop()
    assert wait_until(lambda: [w.worker_id for w in view.snapshot().workers] == ["d2"])
