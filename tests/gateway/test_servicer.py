"""The gateway's client API on a real gRPC server (port 0, in-memory routing store): model
card, tokenizer, validation codes with the numbers, routing errors, duplicate ids, health.

Token streams through real worker processes are in tests/e2e."""

from __future__ import annotations

import math
import time

import grpc
import pytest
from baton.api import convert
from baton.api.requests import GenerateRequest, ModelInfo
from baton.api.v1 import api_pb2, api_pb2_grpc, common_pb2
from baton.config import (
    GatewayRoutingConfig,
    GatewayServiceConfig,
    HttpConfig,
    ModelSourceConfig,
    ServerConfig,
)
from baton.gateway.server import create_server
from baton.routing import InMemoryStore, RequestRecord
from baton.sampling.params import SamplingParams
from commands.cli_checkpoint import save_cli_checkpoint
from grpc_health.v1 import health_pb2, health_pb2_grpc
from test_policy import decode


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return save_cli_checkpoint(tmp_path_factory.mktemp("gateway-model"))


WAIT_FOR_A_POD_S = 0.6  # how long a request waits for a live decode pod here


@pytest.fixture(scope="module")
def gateway(checkpoint):
    store = InMemoryStore()
    config = GatewayServiceConfig(server=ServerConfig(listen="127.0.0.1:0"),
                                  model=ModelSourceConfig(path=str(checkpoint)),
                                  gateway=GatewayRoutingConfig(reroute_wait_s=WAIT_FOR_A_POD_S),
                                  http=HttpConfig(port=0))  # gRPC only: no fixed port 8000
    server, port = create_server(config, store=store)
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    yield server, store, api_pb2_grpc.BatonStub(channel), channel
    channel.close()
    server.stop(0)


def first_status(stub, request: GenerateRequest) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.RpcError) as error:
        list(stub.Generate(convert.generate_request_to_proto(request), timeout=10))
    return error.value.code(), error.value.details()


def test_list_models_and_tokenize_are_served_from_the_checkpoint(gateway, checkpoint):
    server, _, stub, _ = gateway
    models = convert.models_from_proto(stub.ListModels(api_pb2.ListModelsRequest()))
    assert models == [ModelInfo(id=checkpoint.name, revision=checkpoint.name, vocab_size=256,
                                max_model_len=1024, num_layers=3)]
    answer = convert.tokenization_from_proto(stub.Tokenize(api_pb2.TokenizeRequest(text="def f")))
    assert list(answer.token_ids) == server.model.tokenizer.encode("def f")
    assert "".join(answer.pieces) == "def f"


def test_the_gateway_is_serving_only_while_it_sees_a_live_decode_pod(gateway):
    server, store, _, channel = gateway
    health = health_pb2_grpc.HealthStub(channel)

    def status():
        return health.Check(health_pb2.HealthCheckRequest(service="baton.v1.Baton")).status

    assert status() == health_pb2.HealthCheckResponse.NOT_SERVING  # nobody to send work to
    store.register_worker(decode("ready-pod", model=server.model.info.id), ttl_s=60)
    try:
        wait_for(lambda: status() == health_pb2.HealthCheckResponse.SERVING)
    finally:
        store.remove_worker("ready-pod")
    wait_for(lambda: status() == health_pb2.HealthCheckResponse.NOT_SERVING)


def wait_for(condition, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.05)


def raw(**fields) -> api_pb2.GenerateRequest:
    return api_pb2.GenerateRequest(**fields)


@pytest.mark.parametrize("message, words", [
    (raw(text=""), "the prompt is empty"),
    (raw(token_ids=api_pb2.TokenIds(ids=[1, 300])), "[300] are outside the vocabulary 0..255"),
    (raw(text="x", sampling=common_pb2.SamplingParams(max_tokens=0)), "max_tokens must be >= 1, got 0"),
    (raw(text="x", sampling=common_pb2.SamplingParams(temperature=-0.5)), "got -0.5"),
    (raw(text="x", sampling=common_pb2.SamplingParams(temperature=math.nan)), "got nan"),
    (raw(text="x", sampling=common_pb2.SamplingParams(top_p=1.5)), "top_p must be in (0, 1], got 1.5"),
    (raw(token_ids=api_pb2.TokenIds(ids=[1] * 1000), sampling=common_pb2.SamplingParams(max_tokens=30)),
     "1000 tokens + max_tokens 30 = 1030 exceeds the model's limit of 1024"),
    (raw(text="x", compression=common_pb2.CompressionParams(keep_ratio=0)), "keep_ratio must be in (0, 1], got 0"),
    # refused before tokenizing: 1024 tokens of context x 32 bytes
    (raw(text="x" * 40000), "prompt text is 40000 bytes; at most 32768 for a context of 1024 tokens"),
    (raw(text="x", request_id="r" * 300), "request_id is 300 characters; at most 256"),
])
def test_bad_input_is_invalid_argument_naming_the_value(gateway, message, words):
    _, _, stub, _ = gateway
    with pytest.raises(grpc.RpcError) as error:
        list(stub.Generate(message, timeout=10))
    assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert words in error.value.details()
    assert stub.ListModels(api_pb2.ListModelsRequest()).models, "the server keeps serving"


def test_an_unknown_model_is_not_found_naming_it(gateway):
    _, _, stub, _ = gateway
    with pytest.raises(grpc.RpcError) as error:
        list(stub.Generate(raw(text="x", model="llama-70b"), timeout=10))
    assert error.value.code() == grpc.StatusCode.NOT_FOUND
    assert "unknown model 'llama-70b'" in error.value.details()
    with pytest.raises(grpc.RpcError) as error:
        stub.Tokenize(api_pb2.TokenizeRequest(text="x", model="llama-70b"))
    assert error.value.code() == grpc.StatusCode.NOT_FOUND


def test_a_pod_that_registered_after_the_last_view_is_found_before_unavailable(gateway):
    # Right after start-up the gateway's view may predate the decode pods: a request that
    # finds none re-reads the store once instead of failing UNAVAILABLE.
    server, store, stub, _ = gateway
    request = GenerateRequest(text="x", sampling=SamplingParams(max_tokens=2))
    previous_refresh_s = server.generations.view.refresh_s
    server.generations.view.refresh_s = 3600  # no periodic refresh during this test
    server.generations.view.snapshot(fresh=True)  # a view without the pod below
    full = decode("late-pod", free=0, model=server.model.info.id)
    store.register_worker(full, ttl_s=60)
    try:
        time.sleep(0.06)  # older than the shortest interval between two fresh reads
        code, details = first_status(stub, request)
        assert code == grpc.StatusCode.RESOURCE_EXHAUSTED and "out of KV blocks" in details
    finally:
        store.remove_worker(full.worker_id)
        server.generations.view.refresh_s = 0
        server.generations.view.snapshot()  # leave the next test a view without the pod
        server.generations.view.refresh_s = previous_refresh_s


def test_routing_errors_no_decode_pod_is_unavailable_all_full_is_resource_exhausted(gateway):
    server, store, stub, _ = gateway
    request = GenerateRequest(text="x", sampling=SamplingParams(max_tokens=2))
    started = time.monotonic()
    code, details = first_status(stub, request)
    assert code == grpc.StatusCode.UNAVAILABLE and "no decode worker" in details
    assert f"waited {WAIT_FOR_A_POD_S:g} s" in details  # for one to come back, bounded
    assert WAIT_FOR_A_POD_S <= time.monotonic() - started < WAIT_FOR_A_POD_S + 5
    full = decode("full-pod", free=0, model=server.model.info.id)
    store.register_worker(full, ttl_s=60)
    server.generations.view.refresh_s = 0  # read the store on every request
    try:
        code, details = first_status(stub, request)
        assert code == grpc.StatusCode.RESOURCE_EXHAUSTED and "out of KV blocks" in details
    finally:
        store.remove_worker(full.worker_id)


def test_a_live_request_id_is_already_exists(gateway):
    server, store, stub, _ = gateway
    store.put_request(RequestRecord(request_id="taken", decode_address="elsewhere:1"), ttl_s=60)
    store.register_worker(decode("pod", model=server.model.info.id), ttl_s=60)
    server.generations.view.refresh_s = 0
    try:
        code, details = first_status(stub, GenerateRequest(request_id="taken", text="x"))
        assert code == grpc.StatusCode.ALREADY_EXISTS and "'taken'" in details
    finally:
        store.remove_worker("pod")


def test_abort_of_an_unknown_request_finds_nothing(gateway):
    _, _, stub, _ = gateway
    assert not stub.Abort(common_pb2.AbortRequest(request_id="never-seen")).found


def test_the_gateway_registers_itself_for_discovery(gateway):
    server, store, _, _ = gateway
    (record,) = store.list_workers("gateway")
    assert record.address == server.address and record.model_id == server.model.info.id


def test_refused_requests_are_counted_by_status_in_the_metrics(gateway):
    server, _, stub, _ = gateway
    registry = server.metrics.registry
    labels = {"path": "none", "outcome": "INVALID_ARGUMENT"}
    before = registry.get_sample_value("baton_gateway_requests_finished_total", labels) or 0
    with pytest.raises(grpc.RpcError):
        list(stub.Generate(raw(text=""), timeout=10))
    assert registry.get_sample_value("baton_gateway_requests_finished_total", labels) == before + 1
    assert registry.get_sample_value("baton_gateway_requests_in_flight") == 0
