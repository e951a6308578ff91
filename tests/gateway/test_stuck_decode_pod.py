"""A decode pod whose engine gets stuck mid-stream, behind a real gateway with a second pod:
the pod's watchdog fails the stream UNAVAILABLE, the gateway moves it to the other pod
(prompt + tokens sent replayed), and the client receives exactly the greedy tokens of a
fault-free run (the monolithic engine; KV compression off, as it is there)."""

from __future__ import annotations

import grpc
import pytest
from baton.api.v1 import api_pb2, api_pb2_grpc, common_pb2
from baton.routing import InMemoryStore
from decode.decode_servers import (
    PROMPT,
    StuckEngine,
    make_checkpoint,
    reference_tokens,
    start_decode_server,
)
from test_http_api import Gateway
from test_servicer import wait_for

MAX_TOKENS = 300


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("stuck-pod-model"))


def test_a_stream_moves_off_a_pod_whose_engine_is_stuck_and_stays_exact(checkpoint):
    store = InMemoryStore()
    exits: list[str] = []
    pods = [start_decode_server(checkpoint, store, step_stall_s=0.5,
                                exit_process=lambda name=name: exits.append(name))[0]
            for name in ("a", "b")]
    gateway = Gateway(checkpoint, store=store, wait_s=10.0)
    stuck = [StuckEngine(pod.worker.engine) for pod in pods]
    try:
        with grpc.insecure_channel(f"127.0.0.1:{gateway.grpc_port}") as channel:
            stream = api_pb2_grpc.BatonStub(channel).Generate(api_pb2.GenerateRequest(
                token_ids=api_pb2.TokenIds(ids=PROMPT),
                sampling=common_pb2.SamplingParams(temperature=0, max_tokens=MAX_TOKENS,
                                                   ignore_eos=True),
                compression=common_pb2.CompressionParams(enabled=False)), timeout=60)
            tokens = list(next(stream).token_ids)
            # the pods publish their load after each step's tokens: wait for the holder's
            wait_for(lambda: any(pod.worker.load.running_sequences for pod in pods))
            holder = next(i for i, pod in enumerate(pods) if pod.worker.load.running_sequences)
            stuck[holder].armed.set()
            for step in stream:  # (the call's 60 s deadline bounds a stream that never moves)
                tokens += step.token_ids
            # It ended while the holder's engine was still stuck: it moved, it did not wait.
            assert stuck[holder].stuck.is_set() and not stuck[holder].release.is_set()
        assert exits == ["ab"[holder]]
        assert tokens == reference_tokens(checkpoint, PROMPT, MAX_TOKENS)
        migrations = gateway.server.metrics.registry.get_sample_value(
            "baton_gateway_migrations_total", {"code": "UNAVAILABLE"})
        assert migrations == 1
        wait_for(lambda: pods[1 - holder].worker.load.running_sequences == 0)
    finally:
        for engine in stuck:
            engine.release.set()
        gateway.close()
        for pod in pods:
            pod.stop(0)
