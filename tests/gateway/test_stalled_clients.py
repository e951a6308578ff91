"""A client that stops reading its stream, on either door of a real gateway with a real decode
pod: once its window (HTTP/2) or socket buffers (HTTP) are full, it is cut off after
``gateway.stall_s``, its request is aborted, and the gateway serves others meanwhile."""

from __future__ import annotations

import json
import socket
import time

import grpc
import pytest
from baton.api.v1 import api_pb2, api_pb2_grpc, common_pb2
from baton.routing import InMemoryStore
from decode.decode_servers import make_checkpoint, start_decode_server
from test_http_api import Gateway
from test_servicer import wait_for

STALL_S = 0.5
MAX_TOKENS = 900  # far more than fits a 1 KiB window or a small socket buffer
STREAM_S = 120.0  # ample for MAX_TOKENS of the test model on a machine running two test suites
# A client that reads nothing: a 1 KiB HTTP/2 window that never grows.
SMALL_WINDOW = [("grpc.http2.lookahead_bytes", 1024), ("grpc.http2.bdp_probe", 0)]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("stall-model"))


@pytest.fixture
def cluster(checkpoint):
    store = InMemoryStore()
    decode_server, _ = start_decode_server(checkpoint, store=store)
    gateway = Gateway(checkpoint, store=store, wait_s=10.0, stall_s=STALL_S)
    yield gateway, decode_server
    gateway.close()
    decode_server.stop(0)


def in_flight(gateway: Gateway) -> float:
    return gateway.server.metrics.registry.get_sample_value("baton_gateway_requests_in_flight")


def generate_request(request_id: str, max_tokens: int) -> api_pb2.GenerateRequest:
    return api_pb2.GenerateRequest(
        request_id=request_id, token_ids=api_pb2.TokenIds(ids=[5] * 20),
        sampling=common_pb2.SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True))


def test_a_grpc_client_that_stops_reading_is_cut_off_and_its_request_aborted(cluster):
    gateway, decode_server = cluster
    address = f"127.0.0.1:{gateway.grpc_port}"
    with grpc.insecure_channel(address, options=SMALL_WINDOW) as stalled_channel, \
            grpc.insecure_channel(address) as channel:
        stalled = api_pb2_grpc.BatonStub(stalled_channel).Generate(
            generate_request("stalled", MAX_TOKENS), timeout=60)
        wait_for(lambda: in_flight(gateway) == 1)
        wait_for(lambda: in_flight(gateway) == 0, timeout_s=STREAM_S)  # cut off: see below
        wait_for(lambda: decode_server.worker.load.running_sequences == 0)

        # Others are served meanwhile, and the stalled client learns why once it reads.
        steps = list(api_pb2_grpc.BatonStub(channel).Generate(generate_request("next", 8), timeout=30))
        assert sum(len(step.token_ids) for step in steps) == 8
        with pytest.raises(grpc.RpcError) as error:
            list(stalled)
        assert error.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        assert f"read nothing for {STALL_S:g} s" in error.value.details()


def test_an_http_client_that_stops_reading_is_cut_off_and_its_request_aborted(cluster):
    gateway, decode_server = cluster
    body = json.dumps({"model": gateway.server.model.info.id, "prompt": [5] * 20, "stream": True,
                       "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True}).encode()
    # Loopback sockets buffer megabytes, more than the model's longest answer: the gateway's
    # listening socket gets a small send buffer (its connections inherit it), the client a
    # small receive buffer.
    for site in gateway.server.http._runner.sites:
        for listening in site._server.sockets:
            listening.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
    client = socket.socket()
    client.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1024)
    client.connect(("127.0.0.1", int(gateway.url.rsplit(":", 1)[1])))
    try:
        client.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: gateway\r\nContent-Type: "
                       b"application/json\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))
        wait_for(lambda: in_flight(gateway) == 1)
        # The buffers between the handler and the client hold a few hundred events (aiohttp
        # awaits the socket only every 64 KiB it writes): on a loaded machine generating them
        # takes longer than the stall itself. A stream that ended instead of being cut off
        # would carry its [DONE], checked below.
        wait_for(lambda: in_flight(gateway) == 0, timeout_s=STREAM_S)
        wait_for(lambda: decode_server.worker.load.running_sequences == 0)
        status, answer, _ = gateway.post("/v1/completions", {
            "model": gateway.server.model.info.id, "prompt": [5] * 20, "max_tokens": 8,
            "temperature": 0, "ignore_eos": True})
        assert status == 200 and answer["usage"]["completion_tokens"] == 8
        # The stalled connection was closed: reading drains what was sent, then meets its end.
        client.settimeout(10)
        received = b""
        started = time.monotonic()
        while chunk := client.recv(1 << 16):
            received += chunk
            assert time.monotonic() - started < 10
        assert received.startswith(b"HTTP/1.1 200") and b"[DONE]" not in received
        assert received.count(b"data: ") < MAX_TOKENS / 2
    finally:
        client.close()
