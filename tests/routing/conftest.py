"""The routing tests' store: each test that takes ``store`` runs on both implementations."""

from __future__ import annotations

import pytest
from baton.routing import InMemoryStore
from baton.routing.redis_store import RedisStore


@pytest.fixture(params=["memory", "redis"])
def store(request):
    if request.param == "memory":
        yield InMemoryStore()
        return
    server = request.getfixturevalue("redis_server")
    redis_store = RedisStore(server.url, namespace="test")
    yield redis_store
    redis_store.close()
