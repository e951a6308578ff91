"""A decode pod whose engine step never returns (a hung kernel, as the loop sees it): within
``scheduler.step_stall_s`` its streams fail UNAVAILABLE naming the stall, it leaves routing,
answers NOT_SERVING and exits for its supervisor; a pod whose steps return is left alone."""

from __future__ import annotations

import time

import grpc
from baton.decode import server as decode_server
from decode_servers import StuckEngine, decode_stub, start_decode_server
from grpc_health.v1 import health_pb2, health_pb2_grpc
from test_server import generate_request, status_of, wait_until

STALL_S = 0.5
# For pods whose steps return: a bound no step of the test model comes near, even on a
# machine running other suites beside this one (a step is milliseconds; a busy machine's
# slowest seen was ~0.6 s), and busy for twice that, one short step at a time.
BUSY_STALL_S = 3.0


def test_a_stuck_engine_fails_its_streams_unavailable_leaves_routing_and_exits(checkpoint, store):
    exits: list[float] = []
    server, _ = start_decode_server(checkpoint, store, step_stall_s=STALL_S,
                                    exit_process=lambda: exits.append(time.monotonic()))
    engine = StuckEngine(server.worker.engine)
    channel, stub = decode_stub(server.port)
    try:
        health = health_pb2_grpc.HealthStub(channel)
        worker_id = server.describe().worker_id
        assert worker_id in {worker.worker_id for worker in store.list_workers()}
        stream = stub.Generate(generate_request("stuck", max_tokens=500, ignore_eos=True), timeout=30)
        next(stream)  # generating
        engine.armed.set()
        assert engine.stuck.wait(10)
        code, details = status_of(lambda: stream)
        assert code == grpc.StatusCode.UNAVAILABLE
        assert "made no progress" in details and f"step_stall_s {STALL_S:g}" in details
        wait_until(lambda: exits)
        assert STALL_S <= exits[0] - engine.stuck_at < STALL_S + 5
        assert worker_id not in {worker.worker_id for worker in store.list_workers()}
        status = health.Check(health_pb2.HealthCheckRequest(service="")).status
        assert status == health_pb2.HealthCheckResponse.NOT_SERVING
        code, _ = status_of(lambda: stub.Generate(generate_request("after"), timeout=10))
        assert code == grpc.StatusCode.UNAVAILABLE
    finally:
        engine.release.set()
        channel.close()
        server.stop(0)


def test_by_default_a_stalled_pod_stops_its_grpc_server_once_its_streams_failed_then_exits(
        checkpoint, store, monkeypatch):
    """The way out of a real process: the failed stream's status reaches its caller, the
    gRPC server stops, and only then the process ends (here: recorded, not ended)."""
    exits: list[bool] = []
    server, _ = start_decode_server(checkpoint, store, step_stall_s=STALL_S)
    monkeypatch.setattr(decode_server, "exit_stalled_process",
                        lambda: exits.append(server.grpc.loop.is_running()))
    engine = StuckEngine(server.worker.engine)
    channel, stub = decode_stub(server.port)
    try:
        stream = stub.Generate(generate_request("stuck", max_tokens=500, ignore_eos=True), timeout=30)
        next(stream)
        engine.armed.set()
        code, details = status_of(lambda: stream)
        assert code == grpc.StatusCode.UNAVAILABLE and "made no progress" in details
        wait_until(lambda: exits)
        assert exits == [False], "the gRPC server's loop still ran when the process ended"
        code, _ = status_of(lambda: stub.Generate(generate_request("after"), timeout=10))
        assert code == grpc.StatusCode.UNAVAILABLE
    finally:
        engine.release.set()
        channel.close()
        server.watchdog.stop()  # the rest of server.stop(): its gRPC server has stopped
        server.worker.stop()
        if server.prefix_publisher is not None:
            server.prefix_publisher.stop()


def test_steps_that_return_are_never_taken_for_a_stall(checkpoint, store):
    """Busy for twice the bound, one short step at a time: nothing fails."""
    exits: list[float] = []
    server, _ = start_decode_server(checkpoint, store, step_stall_s=BUSY_STALL_S,
                                    exit_process=lambda: exits.append(time.monotonic()))
    channel, stub = decode_stub(server.port)
    try:
        started, request = time.monotonic(), 0
        while time.monotonic() - started < 2 * BUSY_STALL_S:
            messages = list(stub.Generate(generate_request(f"busy-{request}", max_tokens=300,
                                                           ignore_eos=True), timeout=60))
            assert sum(len(message.token_ids) for message in messages) == 300
            request += 1
        assert not exits and server.grpc.serving
    finally:
        channel.close()
        server.stop(0)
