"""How the clients wait for a server to serve: on the health service's Watch stream (a change
ends the wait at once, no repeated checks), through a server that starts late, and to a
TimeoutError naming the address when health never says SERVING. Real gRPC servers on
loopback; the other client calls are tested against a gateway in tests/gateway."""

from __future__ import annotations

import asyncio
import threading
from concurrent import futures

import grpc
import pytest
from baton.client import SERVICE_NAME, AsyncBatonClient, BatonClient
from baton.serving import free_port
from grpc_health.v1 import health_pb2, health_pb2_grpc

WAIT_S = 60.0  # far beyond what any of these waits needs: a failure shows as a timeout
NOT_SERVING = health_pb2.HealthCheckResponse(status=health_pb2.HealthCheckResponse.NOT_SERVING)
SERVING = health_pb2.HealthCheckResponse(status=health_pb2.HealthCheckResponse.SERVING)


class WatchOnlyHealth(health_pb2_grpc.HealthServicer):
    """A health service that answers Watch only (Check is UNIMPLEMENTED): NOT_SERVING, then
    SERVING once the test says so. A client that re-asked Check would never see SERVING."""

    def __init__(self) -> None:
        self.watching = threading.Event()  # a watcher got NOT_SERVING
        self.serve = threading.Event()

    def Watch(self, request, context):
        assert request.service == SERVICE_NAME
        yield NOT_SERVING
        self.watching.set()
        if self.serve.wait(WAIT_S):
            yield SERVING


def start_server(health: health_pb2_grpc.HealthServicer, port: int = 0) -> tuple[grpc.Server, int]:
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    health_pb2_grpc.add_HealthServicer_to_server(health, server)
    port = server.add_insecure_port(f"127.0.0.1:{port}")
    server.start()
    return server, port


@pytest.fixture
def watch_only():
    health = WatchOnlyHealth()
    server, port = start_server(health)
    yield health, f"127.0.0.1:{port}"
    health.serve.set()
    server.stop(0)


def test_the_blocking_client_returns_when_the_watched_health_turns_serving(watch_only):
    health, address = watch_only
    client = BatonClient(address)
    errors: list[BaseException] = []

    def wait():
        try:
            client.wait_until_serving(timeout_s=WAIT_S)
        except BaseException as e:  # noqa: BLE001 - the test reads it
            errors.append(e)

    waiter = threading.Thread(target=wait)
    waiter.start()
    try:
        assert health.watching.wait(WAIT_S)
        assert waiter.is_alive(), "it returned while health said NOT_SERVING"
        health.serve.set()
        waiter.join(WAIT_S)
        assert not waiter.is_alive() and not errors
    finally:
        health.serve.set()
        waiter.join(WAIT_S)
        client.close()


def test_the_asyncio_client_returns_when_the_watched_health_turns_serving(watch_only):
    health, address = watch_only

    async def run():
        async with AsyncBatonClient(address) as client:
            waiting = asyncio.ensure_future(client.wait_until_serving(timeout_s=WAIT_S))
            assert await asyncio.to_thread(health.watching.wait, WAIT_S)
            assert not waiting.done(), "it returned while health said NOT_SERVING"
            health.serve.set()
            await waiting

    asyncio.run(run())


def test_a_client_waiting_before_the_server_starts_sees_it_serve():
    """Nothing listens when the wait begins: the watch waits for the connection."""
    health = WatchOnlyHealth()
    health.serve.set()
    port = free_port()
    client = BatonClient(f"127.0.0.1:{port}")
    waiter = threading.Thread(target=client.wait_until_serving, args=(WAIT_S,))
    waiter.start()
    server, _ = start_server(health, port)
    try:
        waiter.join(WAIT_S)
        assert not waiter.is_alive()
    finally:
        server.stop(0)
        client.close()


def test_a_health_service_that_answers_errors_ends_in_the_timeout_naming_the_address():
    """No Watch (UNIMPLEMENTED): asked again after a back-off until the deadline."""
    server, port = start_server(health_pb2_grpc.HealthServicer())
    address = f"127.0.0.1:{port}"
    try:
        with pytest.raises(TimeoutError, match=f"{address} is not serving after 1 s"):
            BatonClient(address).wait_until_serving(timeout_s=1.0)

        async def run():
            async with AsyncBatonClient(address) as client:
                await client.wait_until_serving(timeout_s=1.0)

        with pytest.raises(TimeoutError, match=f"{address} is not serving after 1 s"):
            asyncio.run(run())
    finally:
        server.stop(0)
