"""A real ``redis-server`` for tests: ``baton up``'s own ManagedRedis (free localhost port,
temp directory, no persistence), with the start/stop/restart the outage tests need.

A stop loses everything, exactly like a Redis pod that restarts without a volume;
``restart()`` brings it back on the same port, so clients reconnect to the same URL.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from baton.local.processes import ManagedRedis

START_TIMEOUT_S = 10.0


def redis_server_binary() -> str | None:
    return shutil.which("redis-server")


class RedisServer:
    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self._redis: ManagedRedis | None = None

    @property
    def url(self) -> str:
        return self._redis.url

    @property
    def port(self) -> int:
        return self._redis.port

    def start(self) -> RedisServer:
        if self._redis is None:
            self._redis = ManagedRedis(self.directory)  # starts it
        else:
            self._redis.start()
        self._redis.wait_ready(START_TIMEOUT_S)
        return self

    def stop(self) -> None:
        if self._redis is not None:
            self._redis.stop()

    def restart(self) -> None:
        self.stop()
        self.start()
