"""Decode pods' prefix-cache events through the routing store into gateways' indexes: both
stores, bounded streams, resynchronisation from snapshots, new processes, expectations."""

from __future__ import annotations

import threading

import pytest
from baton.routing import WorkerInfo
from baton.routing.prefix_index import PrefixIndex, PrefixPublisher, prompt_hashes
from baton.routing.store import StoreUnavailable

BLOCK = 4


def pod(incarnation: str = "one", block_size: int = BLOCK) -> WorkerInfo:
    return WorkerInfo(worker_id="decode-a", role="decode", address="127.0.0.1:5001", model_id="tiny",
                      model_revision="rev-1", version="0.1.0", kv_dtype="float32",
                      incarnation=incarnation, kv_block_size=block_size)


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_the_store_keeps_numbered_events_and_the_latest_snapshot(store):
    store.append_prefix_events("s", [(1, True, "aa"), (2, True, "bb")], ttl_s=30)
    store.append_prefix_events("s", [(3, False, "aa")], ttl_s=30)
    assert store.read_prefix_events("s", 0, 10) == [(1, True, "aa"), (2, True, "bb"), (3, False, "aa")]
    assert store.read_prefix_events("s", 2, 10) == [(3, False, "aa")]
    assert store.read_prefix_events("s", 0, 2) == [(1, True, "aa"), (2, True, "bb")]
    assert store.read_prefix_events("other", 0, 10) == []
    assert store.get_prefix_snapshot("s") is None
    store.put_prefix_snapshot("s", 3, ["bb"], ttl_s=30)
    assert store.get_prefix_snapshot("s") == (3, ["bb"])
    with pytest.raises(ValueError, match="TTL"):
        store.append_prefix_events("s", [], ttl_s=0)


def test_a_gateway_follows_a_pods_events_and_resynchronises_after_a_gap(store):
    worker, index = pod(), PrefixIndex()
    hashes = prompt_hashes(worker, list(range(13)), salt="")
    assert len(hashes) == 3
    store.append_prefix_events(worker.prefix_stream, [(1, True, hashes[0]), (2, True, hashes[1])], 30)
    index.refresh(store, [worker])
    assert index.matched_blocks(worker, hashes) == 2
    store.append_prefix_events(worker.prefix_stream, [(3, True, hashes[2]), (4, False, hashes[1])], 30)
    index.refresh(store, [worker])
    assert index.matched_blocks(worker, hashes) == 1, "an evicted block ends the match"
    # A reader that fell behind: events 5-6 are no longer in the store, a snapshot after 6 is.
    store.put_prefix_snapshot(worker.prefix_stream, 6, [hashes[0], hashes[1]], 30)
    store.append_prefix_events(worker.prefix_stream, [(7, True, hashes[2])], 30)
    behind = PrefixIndex()
    behind.refresh(store, [worker])
    assert behind.matched_blocks(worker, hashes) == 3 and behind.resyncs == 1
    assert prompt_hashes(worker, list(range(13)), salt="tenant-b")[0] not in hashes


def test_a_pods_new_process_starts_empty_and_a_gone_pod_is_forgotten(store):
    old, new, index = pod("one"), pod("two"), PrefixIndex()
    hashes = prompt_hashes(old, list(range(8)), salt="")
    store.append_prefix_events(old.prefix_stream, [(1, True, hashes[0])], 30)
    index.refresh(store, [old])
    assert index.matched_blocks(old, hashes) == 1
    index.refresh(store, [new])
    assert index.matched_blocks(new, hashes) == 0 and index.num_blocks(old) == 0


def test_a_routed_prompt_counts_as_held_until_its_expectation_lapses(store):
    clock = Clock()
    worker, index = pod(), PrefixIndex(clock=clock)
    hashes = prompt_hashes(worker, list(range(9)), salt="")
    index.refresh(store, [worker])
    index.expect(worker, hashes)
    assert index.matched_blocks(worker, hashes) == 2
    clock.now += 31
    assert index.matched_blocks(worker, hashes) == 0


def eventually(condition, timeout_s: float = 5.0) -> bool:
    """Whether ``condition()`` holds within ``timeout_s`` (checked every 20 ms)."""
    pause = threading.Event()
    for _ in range(int(timeout_s / 0.02)):
        if condition():
            return True
        pause.wait(0.02)
    return condition()


def test_the_publisher_writes_what_the_engine_offers_and_snapshots_it(store):
    worker = pod()
    publisher = PrefixPublisher(store, worker.prefix_stream, ttl_s=30, snapshot_every=2).start()
    try:
        publisher.offer([(1, True, "aa"), (2, True, "bb"), (3, False, "aa")])
        index = PrefixIndex()

        def applied() -> bool:
            index.refresh(store, [worker])
            return index.matched_blocks(worker, ["bb"]) == 1 and index.matched_blocks(worker, ["aa"]) == 0

        assert eventually(applied), "the events never reached the store"
        assert eventually(lambda: store.get_prefix_snapshot(worker.prefix_stream) == (3, ["bb"]))
        publisher.offer_snapshot(9, ["cc"])
        assert eventually(lambda: store.get_prefix_snapshot(worker.prefix_stream) == (9, ["cc"]))
    finally:
        publisher.stop()


class FailingStore:
    """A store that is down for its first ``failures`` writes."""

    def __init__(self, inner, failures: int) -> None:
        self.inner, self.failures = inner, failures

    def __getattr__(self, name):
        method = getattr(self.inner, name)
        if not name.startswith(("append", "put")):
            return method

        def write(*args, **kwargs):
            if self.failures > 0:
                self.failures -= 1
                raise StoreUnavailable("down")
            return method(*args, **kwargs)

        return write


def test_events_offered_while_the_store_is_down_arrive_in_order_later(store):
    worker = pod()
    flaky = FailingStore(store, failures=1)
    publisher = PrefixPublisher(flaky, worker.prefix_stream, ttl_s=3).start()
    try:
        publisher.offer([(1, True, "aa")])
        publisher.offer([(2, True, "bb")])
        eventually(lambda: len(store.read_prefix_events(worker.prefix_stream, 0, 10)) == 2, 6.0)
        assert store.read_prefix_events(worker.prefix_stream, 0, 10) == [(1, True, "aa"), (2, True, "bb")]
    finally:
        publisher.stop()
