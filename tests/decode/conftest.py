"""A real decode server on port 0 per test module, over a tiny random checkpoint, and the
monolithic engine's tokens it must stream."""

from __future__ import annotations

import pytest
from baton.routing import InMemoryStore
from decode_servers import (
    MAX_TOKENS,
    PROMPT,
    decode_stub,
    make_checkpoint,
    reference_tokens,
    start_decode_server,
)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("decode-model"))


@pytest.fixture(scope="module")
def reference(checkpoint):
    return reference_tokens(checkpoint, PROMPT, MAX_TOKENS)


@pytest.fixture(scope="module")
def store():
    return InMemoryStore()


@pytest.fixture(scope="module")
def server(checkpoint, store):
    server, _ = start_decode_server(checkpoint, store)
    yield server
    server.stop(0)


@pytest.fixture
def stub(server):
    channel, stub = decode_stub(server.port)
    yield stub
    channel.close()
