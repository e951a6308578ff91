"""Routing state: the store interface, its Redis and in-memory implementations, the workers'
heartbeat and the gateway's outage-proof view. ``open_store`` picks the implementation from
the configuration (``routing.redis_url``: empty = in-memory)."""

from __future__ import annotations

from baton.config import RoutingConfig
from baton.routing.heartbeat import Heartbeat
from baton.routing.memory import InMemoryStore
from baton.routing.store import (
    ROLES,
    RequestRecord,
    RoutingStore,
    StoreUnavailable,
    WorkerInfo,
    WorkerLoad,
)
from baton.routing.view import RoutingSnapshot, RoutingView


def open_store(config: RoutingConfig) -> RoutingStore:
    if not config.redis_url:
        return InMemoryStore()
    from baton.routing.redis_store import RedisStore  # the redis client only when configured

    return RedisStore(config.redis_url, namespace=config.namespace,
                      timeout_s=config.redis_timeout_s)


__all__ = ["ROLES", "Heartbeat", "InMemoryStore", "RequestRecord", "RoutingSnapshot",
           "RoutingStore", "RoutingView", "StoreUnavailable", "WorkerInfo", "WorkerLoad",
           "open_store"]
