"""The routing tests' store: each test that takes ``store`` runs on both implementations."""

from __future__ import annotations

import pytest
from baton.routing import InMemoryStore
from baton.routing.redis_store import RedisStore


class TestClock:
    """The in-memory store's clock in a test: time passes when the test says so."""

    def __init__(self) -> None:
        self.now_s = 1000.0

    def __call__(self) -> float:
        return self.now_s


@pytest.fixture(params=["memory", "redis"])
def store(request):
    if request.param == "memory":
        memory = InMemoryStore(clock=TestClock())
        yield memory
        return
    server = request.getfixturevalue("redis_server")
    redis_store = RedisStore(server.url, namespace="test")
    yield redis_store
    redis_store.close()
