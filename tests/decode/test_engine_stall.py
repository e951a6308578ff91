"""A decode pod whose engine step never returns (a hung kernel, as the loop sees it): within
``scheduler.step_stall_s`` its streams fail UNAVAILABLE naming the stall, it leaves routing,
answers NOT_SERVING and exits for its supervisor; a pod whose steps return is left alone."""

from __future__ import annotations

import time

import grpc
from decode_servers import StuckEngine, decode_stub, start_decode_server
from grpc_health.v1 import health_pb2, health_pb2_grpc
from test_server import generate_request, status_of, wait_until

STALL_S = 0.5


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


def test_steps_that_return_are_never_taken_for_a_stall(checkpoint, store):
    """Busy for many times the bound, one short step at a time: nothing fails."""
    exits: list[float] = []
    server, _ = start_decode_server(checkpoint, store, step_stall_s=STALL_S,
                                    exit_process=lambda: exits.append(time.monotonic()))
    channel, stub = decode_stub(server.port)
    try:
        started, request = time.monotonic(), 0
        while time.monotonic() - started < 3 * STALL_S:
            messages = list(stub.Generate(generate_request(f"busy-{request}", max_tokens=300,
                                                           ignore_eos=True), timeout=60))
            assert sum(len(message.token_ids) for message in messages) == 300
            request += 1
        assert not exits and server.grpc.serving
    finally:
        channel.close()
        server.stop(0)
