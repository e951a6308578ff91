"""The gRPC server every service runs on: ports are bound exclusively."""

from __future__ import annotations

import pytest
from baton.config import ServerConfig
from baton.serving import GrpcServer


def test_a_second_server_on_a_taken_address_fails_with_a_clear_message():
    first = GrpcServer(ServerConfig(listen="127.0.0.1:0"), lambda server: None, [])
    try:
        taken = f"127.0.0.1:{first.port}"
        with pytest.raises(ValueError, match=f"cannot bind the gRPC server to '{taken}': the address is in use"):
            GrpcServer(ServerConfig(listen=taken), lambda server: None, [])
    finally:
        first.server.stop(0)
