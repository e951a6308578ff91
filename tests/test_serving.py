"""The gRPC servers every service runs on: ports are bound exclusively, and the asynchronous
one takes a burst of thousands of streams without dropping any."""

from __future__ import annotations

import asyncio

import grpc
import pytest
from baton.config import ServerConfig
from baton.serving import AsyncGrpcServer


def test_a_second_server_on_a_taken_address_fails_with_a_clear_message():
    first = AsyncGrpcServer(ServerConfig(listen="127.0.0.1:0"), lambda server: None, [])
    try:
        taken = f"127.0.0.1:{first.port}"
        with pytest.raises(ValueError, match=f"cannot bind the gRPC server to '{taken}': the address is in use"):
            AsyncGrpcServer(ServerConfig(listen=taken), lambda server: None, [])
    finally:
        first.stop(0)


async def _three_messages(request, context):
    for _ in range(3):
        await asyncio.sleep(0.01)
        yield request


def test_a_burst_of_streams_beyond_grpcs_pending_call_default_all_complete():
    # gRPC's core cancels calls beyond 1,000 that wait to be taken unless told otherwise.
    handler = grpc.method_handlers_generic_handler(
        "test.Burst", {"Stream": grpc.unary_stream_rpc_method_handler(_three_messages)})
    server = AsyncGrpcServer(ServerConfig(listen="127.0.0.1:0"),
                             lambda s: s.add_generic_rpc_handlers((handler,)), [])

    async def burst(count: int) -> list[int]:
        async with grpc.aio.insecure_channel(server.address) as channel:
            call = channel.unary_stream("/test.Burst/Stream")

            async def one() -> int:
                return len([message async for message in call(b"x", timeout=60)])

            return await asyncio.gather(*(one() for _ in range(count)), return_exceptions=True)

    try:
        assert asyncio.run(burst(1500)) == [3] * 1500
    finally:
        server.stop(0)


def test_a_client_message_larger_than_the_limit_is_resource_exhausted():
    handler = grpc.method_handlers_generic_handler(
        "test.Burst", {"Stream": grpc.unary_stream_rpc_method_handler(_three_messages)})
    server = AsyncGrpcServer(ServerConfig(listen="127.0.0.1:0", max_message_mib=1),
                             lambda s: s.add_generic_rpc_handlers((handler,)), [])
    try:
        with grpc.insecure_channel(server.address) as channel:
            call = channel.unary_stream("/test.Burst/Stream")
            assert len(list(call(b"x" * (1 << 19), timeout=10))) == 3  # half a MiB: served
            with pytest.raises(grpc.RpcError) as error:
                list(call(b"x" * (2 << 20), timeout=10))
        assert error.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    finally:
        server.stop(0)
