"""Both routing stores pass one suite: records, TTL expiry, the request table, heartbeats."""

from __future__ import annotations

import dataclasses
import json
import time

import pytest
from baton.api.requests import MAX_POD_REQUEST_ID_CHARS, MAX_REQUEST_ID_CHARS, check_request_id
from baton.config import RoutingConfig
from baton.kv.contract import HEADS_COMPLETE, KVContract
from baton.routing import (
    Heartbeat,
    InMemoryStore,
    RequestRecord,
    StoreUnavailable,
    WorkerInfo,
    WorkerLoad,
    open_store,
)
from baton.routing.redis_store import RedisStore

# Redis keeps its own time: long enough that a record is surely there when the test looks
# right after writing it, even on a loaded machine (the in-memory store's clock is the test's).
TTL_S = 2.0


def worker(worker_id: str, role: str = "decode", **load) -> WorkerInfo:
    return WorkerInfo(worker_id=worker_id, role=role, address=f"127.0.0.1:{5000 + len(worker_id)}",
                      model_id="tiny", model_revision="rev-1", version="0.1.0",
                      load=WorkerLoad(**load))


def wait_until(condition, timeout_s: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.02)
    return condition()


def test_register_and_list(store):
    store.register_worker(worker("d2", free_kv_blocks=5), ttl_s=30)
    store.register_worker(worker("d1", free_kv_blocks=9), ttl_s=30)
    prefill = WorkerInfo("p0", "prefill", "127.0.0.1:6000", "tiny", "rev-1", "0.1.0",
                         chain_id="chain-0", rank=1, num_ranks=2)
    store.register_worker(prefill, ttl_s=30)
    assert [w.worker_id for w in store.list_workers()] == ["d1", "d2", "p0"]
    assert store.list_workers("prefill") == [prefill]
    assert [w.load.free_kv_blocks for w in store.list_workers("decode")] == [9, 5]


def test_reregistering_updates_the_load(store):
    store.register_worker(worker("d1", running_sequences=1), ttl_s=30)
    store.register_worker(worker("d1", running_sequences=7), ttl_s=30)
    (only,) = store.list_workers()
    assert only.load.running_sequences == 7


def let_expire(store, gone) -> None:
    """Until ``gone()``: the in-memory store's clock moves past TTL_S; Redis's passes it."""
    if isinstance(store, InMemoryStore):
        clock = store._clock  # the conftest's TestClock
        clock.now_s += TTL_S - 0.001
        assert not gone(), "expired before its TTL"
        clock.now_s += 0.001
        assert gone()
        return
    assert wait_until(gone, timeout_s=TTL_S + 10), f"not expired within {TTL_S + 10} s"


def test_worker_expires_after_its_ttl(store):
    store.register_worker(worker("short"), ttl_s=TTL_S)
    store.register_worker(worker("long"), ttl_s=30)
    assert len(store.list_workers()) == 2
    let_expire(store, lambda: [w.worker_id for w in store.list_workers()] == ["long"])


def test_remove_worker(store):
    store.register_worker(worker("d1"), ttl_s=30)
    store.remove_worker("d1")
    store.remove_worker("never-registered")
    assert store.list_workers() == []


def test_request_table(store):
    record = RequestRecord("req-1", decode_address="127.0.0.1:5001", chain_id="chain-0",
                           prefill_address="127.0.0.1:6000", created_at=1.5)
    assert store.put_request(record, ttl_s=30, if_absent=True)
    duplicate = RequestRecord("req-1", decode_address="elsewhere:1")
    assert not store.put_request(duplicate, ttl_s=30, if_absent=True)
    assert store.get_request("req-1") == record
    assert store.put_request(duplicate, ttl_s=30)  # an explicit overwrite
    assert store.get_request("req-1") == duplicate
    store.remove_request("req-1")
    assert store.get_request("req-1") is None
    assert store.get_request("unknown") is None


def test_request_expires_after_its_ttl(store):
    store.put_request(RequestRecord("req-2", "127.0.0.1:5001"), ttl_s=TTL_S)
    assert store.get_request("req-2") is not None
    let_expire(store, lambda: store.get_request("req-2") is None)
    assert store.put_request(RequestRecord("req-2", "127.0.0.1:5002"), ttl_s=30, if_absent=True)


def test_non_positive_ttl_is_refused(store):
    with pytest.raises(ValueError, match="TTL must be > 0 seconds, got 0"):
        store.register_worker(worker("d1"), ttl_s=0)


def test_heartbeat_keeps_a_worker_alive_and_stopping_it_expires_it(store):
    load = {"running_sequences": 0}

    def describe() -> WorkerInfo:
        load["running_sequences"] += 1
        return worker("beating", **load)

    heartbeat = Heartbeat(store, describe, interval_s=0.05, ttl_s=TTL_S).start()
    try:
        assert [w.worker_id for w in store.list_workers()] == ["beating"]  # registered at start
        time.sleep(TTL_S + 0.5)  # outlives one TTL only through heartbeats
        (alive,) = store.list_workers()
        assert alive.load.running_sequences > 1, "each beat carries the live load"
    finally:
        heartbeat.stop(deregister=False)  # as if the worker died: no goodbye
    let_expire(store, lambda: store.list_workers() == [])


def test_heartbeat_stop_deregisters_at_once(store):
    with Heartbeat(store, lambda: worker("polite"), interval_s=0.05, ttl_s=30):
        assert len(store.list_workers()) == 1
    assert store.list_workers() == []


def test_heartbeat_interval_must_be_below_ttl(store):
    with pytest.raises(ValueError, match="interval_s 2 must be > 0 and below ttl_s 1"):
        Heartbeat(store, lambda: worker("x"), interval_s=2, ttl_s=1)


def test_worker_info_validates():
    with pytest.raises(ValueError, match="role 'chef'"):
        WorkerInfo("w", "chef", "h:1", "m", "r", "v")
    with pytest.raises(ValueError, match="rank 2 is outside 0..1"):
        WorkerInfo("w", "prefill", "h:1", "m", "r", "v", rank=2, num_ranks=2)


def test_records_of_another_release_stay_readable():
    # A newer worker's record during a rolling upgrade: fields this release does not know are
    # left out; an older worker's record lacks fields, which take their defaults.
    chain = WorkerInfo("p0", "prefill", "h:1", "m", "r", "v", chain_id="c", num_ranks=2,
                       break_even_tokens=8192)
    assert WorkerInfo.from_json(chain.to_json()) == chain
    newer = json.loads(chain.to_json()) | {"gpu_kind": "h100"}
    newer["load"] |= {"kv_bytes_free": 1}
    assert WorkerInfo.from_json(json.dumps(newer)) == chain
    older = json.loads(chain.to_json())
    del older["break_even_tokens"], older["incarnation"]
    assert WorkerInfo.from_json(json.dumps(older)).break_even_tokens == 0
    record = RequestRecord("r1", "h:2", owner="team-a")
    assert RequestRecord.from_json(json.dumps(json.loads(record.to_json()) | {"priority": 3})) == record
    assert RequestRecord.from_json(json.dumps({"request_id": "r1", "decode_address": "h:2"})).owner == ""


def test_a_worker_publishes_its_kv_contract(store):
    contract = KVContract("tiny", "rev-1", dtype="bfloat16", num_layers=4, num_kv_heads=2,
                          head_dim=8, layout=HEADS_COMPLETE, compression="off", block_size=16,
                          tensor_parallel_size=2)
    store.register_worker(dataclasses.replace(worker("d1"), kv_dtype="bfloat16",
                                              kv_contract=contract), ttl_s=30)
    (only,) = store.list_workers()
    assert only.contract == contract


def test_contracts_of_another_release_stay_readable():
    # An earlier release's record has no contract: its model, revision and dtype stand for it.
    # A newer release's contract may say more than this one knows: that is left out.
    older = dataclasses.replace(worker("d1"), kv_dtype="float32")
    assert WorkerInfo.from_json(older.to_json()).contract == KVContract("tiny", "rev-1",
                                                                        dtype="float32")
    contract = KVContract("tiny", "rev-1", dtype="float32", num_layers=4)
    newer = json.loads(dataclasses.replace(older, kv_contract=contract).to_json())
    newer["kv_contract"] |= {"kv_scales": "per-head"}
    assert WorkerInfo.from_json(json.dumps(newer)).contract == contract


def test_a_request_sent_to_a_chain_again_has_a_pod_id_of_its_own_within_the_pods_limit():
    first = RequestRecord("r" * MAX_REQUEST_ID_CHARS, "h:2")
    assert first.pod_request_id == first.request_id
    retried = dataclasses.replace(first, attempt=3)
    assert RequestRecord.from_json(retried.to_json()) == retried
    assert retried.pod_request_id == first.request_id + "~3"
    check_request_id(retried.pod_request_id, MAX_POD_REQUEST_ID_CHARS)  # a pod accepts it
    with pytest.raises(ValueError, match="at most 256"):
        check_request_id(retried.pod_request_id)  # a client may not send it


def test_redis_namespaces_are_separate_and_bad_records_are_skipped(redis_server):
    ours, theirs = RedisStore(redis_server.url, "ours"), RedisStore(redis_server.url, "theirs")
    ours.register_worker(worker("d1"), ttl_s=30)
    theirs.register_worker(worker("d2"), ttl_s=30)
    ours._client.set("ours:worker:garbage", b"{not json")
    assert [w.worker_id for w in ours.list_workers()] == ["d1"]
    assert [w.worker_id for w in theirs.list_workers()] == ["d2"]


def test_redis_down_is_store_unavailable(redis_server):
    store = RedisStore(redis_server.url, timeout_s=0.5)
    redis_server.stop()
    started = time.monotonic()
    with pytest.raises(StoreUnavailable, match="unreachable"):
        store.list_workers()
    assert time.monotonic() - started < 3, "an outage must be noticed quickly"


def test_open_store_follows_the_config(redis_server):
    assert isinstance(open_store(RoutingConfig()), InMemoryStore)
    store = open_store(RoutingConfig(redis_url=redis_server.url, namespace="cfg"))
    assert isinstance(store, RedisStore) and store.namespace == "cfg"
    with pytest.raises(ValueError, match="'http://x' is not a redis://"):
        open_store(RoutingConfig(redis_url="http://x"))
