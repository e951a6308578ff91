"""Traces and the request log of a whole local cluster (real processes, a real redis-server)
exporting to an OTLP receiver in this process: one trace per request across the door, the
router, both chain ranks, the KV push and the decode pod; the caller's traceparent honoured
at the HTTP door and in gRPC metadata; JSON log lines with the request log's fields."""

from __future__ import annotations

import json
import secrets
import urllib.request

import grpc
import pytest
from baton.api import convert
from baton.api.requests import GenerateRequest
from baton.api.v1 import api_pb2_grpc
from baton.config import LogConfig, OtlpConfig
from baton.local.cluster import LocalCluster
from baton.local.spec import ClusterSpec
from baton.model.hub import SHIPPED_MODEL_DIR
from baton.model.tokenizer import Tokenizer
from baton.serving import free_port
from e2e_cluster import CHAIN_THRESHOLD_TOKENS, greedy, long_prompt_ids, skip_without_cluster_parts
from otlp_receiver import OtlpReceiver

pytestmark = pytest.mark.slow

SPANS_WAIT_S = 30.0
MAX_TOKENS = 6


@pytest.fixture(scope="module")
def receiver():
    receiver = OtlpReceiver()
    yield receiver
    receiver.stop()


@pytest.fixture(scope="module")
def traced(receiver, tmp_path_factory):
    skip_without_cluster_parts()
    spec = ClusterSpec(decode_workers=1, chain_ranks=2, prefill_threshold_tokens=CHAIN_THRESHOLD_TOKENS,
                       chain_break_even=False, gateway_http_port=free_port(),
                       otlp=OtlpConfig(traces_endpoint=receiver.endpoint),
                       log=LogConfig(format="json", requests=True))
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("OTEL_BSP_SCHEDULE_DELAY", "50")  # the children export within 50 ms
        with LocalCluster(spec, log_dir=tmp_path_factory.mktemp("traced-logs")) as cluster:
            yield cluster


def _traceparent() -> tuple[str, str, str]:
    trace_id, span_id = secrets.token_hex(16), secrets.token_hex(8)
    return f"00-{trace_id}-{span_id}-01", trace_id, span_id


def _complete(cluster: LocalCluster, prompt, traceparent: str) -> dict:
    body = json.dumps({"prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0}).encode()
    request = urllib.request.Request(f"{cluster.gateway_http_url}/completions", data=body,
                                     headers={"Content-Type": "application/json",
                                              "traceparent": traceparent})
    with urllib.request.urlopen(request, timeout=120) as response:
        return json.loads(response.read())


def _names(spans) -> set[tuple[str, str]]:
    return {(span.service, span.name) for span in spans}


def _assert_one_tree(spans, root_parent: str) -> None:
    """Every span's parent is another span of the trace, or the caller's span."""
    ids = {span.span_id for span in spans}
    for span in spans:
        assert span.parent_span_id in ids | {root_parent}, (span.service, span.name)
        assert span.end_ns >= span.start_ns


CHAIN_SPANS = {("baton-gateway", "baton.gateway.request"), ("baton-gateway", "baton.gateway.admit"),
               ("baton-gateway", "baton.gateway.route"), ("baton-prefill", "baton.prefill.queue"),
               ("baton-prefill", "baton.prefill.rank"), ("baton-prefill", "baton.kv.push"),
               ("baton-decode", "baton.kv.receive"), ("baton-decode", "baton.decode.request"),
               ("baton-decode", "baton.decode.first_step")}


def test_a_long_prompt_is_one_trace_across_door_router_ranks_push_and_decode_pod(traced, receiver):
    prompt = long_prompt_ids(Tokenizer.from_dir(SHIPPED_MODEL_DIR), CHAIN_THRESHOLD_TOKENS + 40)
    traceparent, trace_id, client_span = _traceparent()
    answer = _complete(traced, prompt, traceparent)
    assert answer["baton"]["route"]["path"] == "chain"

    def complete(spans) -> bool:
        ours = [span for span in spans if span.trace_id == trace_id]
        return CHAIN_SPANS <= _names(ours) and sum(s.name == "baton.prefill.rank" for s in ours) == 2

    receiver.wait_for(complete, SPANS_WAIT_S)
    spans = receiver.trace(trace_id)
    _assert_one_tree(spans, client_span)
    (request,) = [s for s in spans if s.name == "baton.gateway.request"]
    assert request.parent_span_id == client_span  # the caller's traceparent, honoured
    assert request.attributes["baton.route"] == "chain"
    assert request.attributes["baton.completion_tokens"] == MAX_TOKENS
    (route,) = [s for s in spans if s.name == "baton.gateway.route"]
    assert route.attributes["baton.route.path"] == "chain"
    assert f">= prefill_threshold_tokens {CHAIN_THRESHOLD_TOKENS}" in route.attributes["baton.route.reason"]
    ranks = sorted((s.attributes["baton.rank"], s.attributes["baton.slice.start"],
                    s.attributes["baton.slice.end"]) for s in spans if s.name == "baton.prefill.rank")
    assert [rank for rank, _, _ in ranks] == [0, 1]
    assert ranks[0][1] == 0 and ranks[0][2] == ranks[1][1] and ranks[1][2] == len(prompt)
    by_id = {s.span_id: s for s in spans}
    (receive,) = [s for s in spans if s.name == "baton.kv.receive"]
    assert by_id[receive.parent_span_id].name == "baton.kv.push"  # the push's metadata
    assert by_id[receive.parent_span_id].attributes["baton.kv.bytes"] > 0
    (decode,) = [s for s in spans if s.name == "baton.decode.request"]
    assert decode.attributes["baton.pushed"] is True and decode.parent_span_id == receive.span_id


def test_a_short_prompt_over_grpc_is_traced_on_the_local_route(traced, receiver):
    traceparent, trace_id, client_span = _traceparent()
    request = GenerateRequest(text="def fibonacci(n):\n", sampling=greedy(MAX_TOKENS))
    with grpc.insecure_channel(traced.gateway_address) as channel:
        messages = list(api_pb2_grpc.BatonStub(channel).Generate(
            convert.generate_request_to_proto(request), metadata=(("traceparent", traceparent),),
            timeout=120))
    request_id = messages[0].request_id

    wanted = {("baton-gateway", "baton.gateway.request"), ("baton-gateway", "baton.gateway.route"),
              ("baton-decode", "baton.decode.request"), ("baton-decode", "baton.decode.first_step")}
    receiver.wait_for(lambda spans: wanted <= _names(s for s in spans if s.trace_id == trace_id),
                      SPANS_WAIT_S)
    spans = receiver.trace(trace_id)
    _assert_one_tree(spans, client_span)
    assert not {name for _, name in _names(spans)} & {"baton.prefill.rank", "baton.kv.push"}
    (root,) = [s for s in spans if s.name == "baton.gateway.request"]
    assert root.parent_span_id == client_span and root.attributes["baton.id"] == request_id
    (route,) = [s for s in spans if s.name == "baton.gateway.route"]
    assert route.attributes["baton.route.path"] == "local"
    assert "prefilled on the decode pod" in route.attributes["baton.route.reason"]
    (decode,) = [s for s in spans if s.name == "baton.decode.request"]
    assert decode.attributes["baton.pushed"] is False


def test_json_logs_carry_one_request_line_per_request(traced, receiver):
    traceparent, trace_id, _ = _traceparent()
    answer = _complete(traced, "import os\n", traceparent)
    # the request's span ends after its log line is written
    receiver.wait_for(lambda spans: any(s.trace_id == trace_id and s.name == "baton.gateway.request"
                                        for s in spans), SPANS_WAIT_S)
    lines = [json.loads(line) for line in (traced.log_dir / "gateway.log").read_text().splitlines()
             if line.startswith("{")]
    assert {"time", "level", "logger", "message"} <= set(lines[0])
    (logged,) = [line for line in lines if line["logger"] == "baton.requests"
                 and line.get("id") == answer["id"]]
    assert logged["route"] == "local" and logged["outcome"] == "length"
    assert logged["completion_tokens"] == MAX_TOKENS and logged["prompt_tokens"] > 0
    assert 0 < logged["ttft_s"] <= logged["total_s"]
    assert logged["decode"] and logged["message"].startswith(f"request id={answer['id']} ")
