"""``RedisStore``: the routing store of a cluster.

Keys (``namespace`` lets deployments share one Redis):

    {namespace}:worker:{worker_id}    a WorkerInfo as JSON, SET with PX = the worker TTL
    {namespace}:request:{request_id}  a RequestRecord as JSON, SET with PX (NX for a new id)
    {namespace}:prefix:{stream}       a pod's prefix-cache events: a Redis stream whose entry
                                      ids are the events' numbers (``N-1``), capped by MAXLEN
    {namespace}:prefix-snapshot:{stream}  {"upto": N, "hashes": [...]} as JSON, SET with PX

Listing workers is a SCAN over the worker prefix plus one MGET: there is no index to keep
consistent, and an expired key is gone from both. Every Redis connection or timeout error
becomes ``StoreUnavailable``; one immediate retry per command rides over a pooled
connection that died with a Redis restart.
"""

from __future__ import annotations

import functools
import json
import logging
from collections.abc import Callable
from typing import Any, TypeVar

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from baton.config import RoutingConfig
from baton.routing.store import (
    MAX_PREFIX_EVENTS,
    PrefixEvent,
    RequestRecord,
    RoutingStore,
    StoreUnavailable,
    WorkerInfo,
    check_ttl,
)

log = logging.getLogger(__name__)
T = TypeVar("T")
SCAN_BATCH = 512  # keys per SCAN round trip


def _unavailable_on_redis_errors(method: Callable[..., T]) -> Callable[..., T]:
    @functools.wraps(method)
    def wrapper(self: RedisStore, *args: Any, **kwargs: Any) -> T:
        try:
            return method(self, *args, **kwargs)
        except (redis.ConnectionError, redis.TimeoutError) as e:
            raise StoreUnavailable(f"routing store {self.url} is unreachable: {e}") from e

    return wrapper


class RedisStore(RoutingStore):
    def __init__(self, url: str, namespace: str = RoutingConfig.namespace,
                 timeout_s: float = RoutingConfig.redis_timeout_s) -> None:
        if not url.startswith(("redis://", "rediss://", "unix://")):
            raise ValueError(f"routing redis_url {url!r} is not a redis://, rediss:// or "
                             f"unix:// URL")
        self.url = url
        self.namespace = namespace
        self._client = redis.Redis.from_url(url, socket_timeout=timeout_s,
                                            socket_connect_timeout=timeout_s,
                                            retry=Retry(NoBackoff(), 1))

    def _worker_key(self, worker_id: str) -> str:
        return f"{self.namespace}:worker:{worker_id}"

    def _request_key(self, request_id: str) -> str:
        return f"{self.namespace}:request:{request_id}"

    @_unavailable_on_redis_errors
    def register_worker(self, worker: WorkerInfo, ttl_s: float) -> None:
        check_ttl(ttl_s)
        self._client.set(self._worker_key(worker.worker_id), worker.to_json(),
                         px=max(1, round(ttl_s * 1000)))

    @_unavailable_on_redis_errors
    def remove_worker(self, worker_id: str) -> None:
        self._client.delete(self._worker_key(worker_id))

    @_unavailable_on_redis_errors
    def list_workers(self, role: str | None = None) -> list[WorkerInfo]:
        keys = list(self._client.scan_iter(match=self._worker_key("*"), count=SCAN_BATCH))
        workers = []
        for key, value in zip(keys, self._client.mget(keys) if keys else []):
            if value is None:  # expired between SCAN and MGET
                continue
            try:
                worker = WorkerInfo.from_json(value)
            except (ValueError, TypeError) as e:  # a record this release cannot read
                log.warning("ignoring routing record %s: %s", key, e)
                continue
            if role is None or worker.role == role:
                workers.append(worker)
        return sorted(workers, key=lambda worker: worker.worker_id)

    @_unavailable_on_redis_errors
    def put_request(self, record: RequestRecord, ttl_s: float, if_absent: bool = False) -> bool:
        check_ttl(ttl_s)
        written = self._client.set(self._request_key(record.request_id), record.to_json(),
                                   px=max(1, round(ttl_s * 1000)), nx=if_absent)
        return bool(written)

    @_unavailable_on_redis_errors
    def get_request(self, request_id: str) -> RequestRecord | None:
        value = self._client.get(self._request_key(request_id))
        return None if value is None else RequestRecord.from_json(value)

    @_unavailable_on_redis_errors
    def remove_request(self, request_id: str) -> None:
        self._client.delete(self._request_key(request_id))

    @_unavailable_on_redis_errors
    def append_prefix_events(self, stream: str, events: list[PrefixEvent], ttl_s: float) -> None:
        check_ttl(ttl_s)
        key = f"{self.namespace}:prefix:{stream}"
        pipeline = self._client.pipeline(transaction=False)
        for number, stored, block_hash in events:
            pipeline.xadd(key, {"e": f"{'s' if stored else 'e'}{block_hash}"}, id=f"{number}-1",
                          maxlen=MAX_PREFIX_EVENTS, approximate=True)
        pipeline.pexpire(key, max(1, round(ttl_s * 1000)))
        pipeline.execute()

    @_unavailable_on_redis_errors
    def read_prefix_events(self, stream: str, after: int, limit: int) -> list[PrefixEvent]:
        entries = self._client.xrange(f"{self.namespace}:prefix:{stream}", min=f"{after + 1}-0",
                                      count=limit)
        events = []
        for entry_id, fields in entries:
            value = fields[b"e"].decode()
            events.append((int(entry_id.split(b"-")[0]), value[0] == "s", value[1:]))
        return events

    @_unavailable_on_redis_errors
    def put_prefix_snapshot(self, stream: str, upto: int, hashes: list[str], ttl_s: float) -> None:
        check_ttl(ttl_s)
        self._client.set(f"{self.namespace}:prefix-snapshot:{stream}",
                         json.dumps({"upto": upto, "hashes": hashes}), px=max(1, round(ttl_s * 1000)))

    @_unavailable_on_redis_errors
    def get_prefix_snapshot(self, stream: str) -> tuple[int, list[str]] | None:
        value = self._client.get(f"{self.namespace}:prefix-snapshot:{stream}")
        if value is None:
            return None
        snapshot = json.loads(value)
        return snapshot["upto"], snapshot["hashes"]

    def close(self) -> None:
        self._client.close()
