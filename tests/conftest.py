"""Fixtures shared by every test area."""

from __future__ import annotations

import os

import pytest
from redis_server import RedisServer, redis_server_binary

# fp32 is the reference for exactness: every service a test starts (in process or as a
# child process) computes in fp32 unless the test says otherwise, whatever "auto" picks
# on the machine.
os.environ.setdefault("BATON_MODEL_DTYPE", "float32")


@pytest.fixture
def redis_server(tmp_path):
    """A real redis-server on a free port, stopped after the test (skips when not installed)."""
    if redis_server_binary() is None:
        pytest.skip("redis-server is not installed; `make setup` installs it")
    server = RedisServer(tmp_path).start()
    try:
        yield server
    finally:
        server.stop()
