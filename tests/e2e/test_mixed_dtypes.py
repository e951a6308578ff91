"""Pods that resolved different dtypes (`dtype auto` on nodes of mixed CPUs, or a setting
given to one role only): here the decode pod computes fp32 and the chain bf16. Their KV
contracts, published in their routing records, do not fit, so the gateway never pairs them:
a long prompt is prefilled on the decode pod (no chain, so no push for the pod to refuse),
the route's reason names the chain passed over and the mismatch, the gateway counts it, and
the tokens are the fault-free ones. One pinned to the chain is refused with the cause instead of
failing after a refused push."""

from __future__ import annotations

import urllib.request

import grpc
import pytest
from baton.api.requests import CompressionParams, GenerateRequest
from baton.client import BatonClient
from baton.local.cluster import LocalCluster
from baton.local.spec import ClusterSpec
from baton.serving import free_port
from e2e_cluster import CHAIN_THRESHOLD_TOKENS, greedy, long_prompt_ids, skip_without_cluster_parts

pytestmark = pytest.mark.slow
MAX_TOKENS = 8
MISMATCH = "chain chain-0 skipped: kv dtype bfloat16 != float32"


@pytest.fixture(scope="module")
def mixed_cluster(tmp_path_factory):
    skip_without_cluster_parts()
    metrics_port = free_port()
    spec = ClusterSpec(decode_workers=1, chain_ranks=2, prefill_threshold_tokens=CHAIN_THRESHOLD_TOKENS,
                       chain_break_even=False, heartbeat_s=0.5,
                       extra_args={"decode": ["--model-dtype", "float32"],
                                   "prefill": ["--model-dtype", "bfloat16"],
                                   "gateway": ["--gateway-reroute-wait-s", "1",
                                               "--server-metrics-port", str(metrics_port)]})
    with LocalCluster(spec, log_dir=tmp_path_factory.mktemp("mixed-logs")) as cluster:
        client = BatonClient(cluster.gateway_address)
        client.wait_until_serving(timeout_s=30)
        yield cluster, client, f"http://127.0.0.1:{metrics_port}/metrics"
        client.close()


def counted_mismatches(metrics_url: str) -> float:
    with urllib.request.urlopen(metrics_url, timeout=10) as response:
        for line in response.read().decode().splitlines():
            if line.startswith("baton_gateway_kv_contract_mismatches_total "):
                return float(line.split()[1])
    raise AssertionError("the gateway exports no baton_gateway_kv_contract_mismatches_total")


def test_a_long_prompt_stays_on_a_decode_pod_whose_contract_the_chain_does_not_fit(mixed_cluster,
                                                                                 reference):
    _, client, metrics_url = mixed_cluster
    before = counted_mismatches(metrics_url)
    prompt = tuple(long_prompt_ids(reference.tokenizer, CHAIN_THRESHOLD_TOKENS + 40))
    completion = client.generate(GenerateRequest(
        token_ids=prompt, sampling=greedy(MAX_TOKENS), compression=CompressionParams(enabled=False)),
        timeout_s=60)
    route = completion.last.route
    assert not route.chain_id
    assert MISMATCH in route.reason and route.reason.endswith("prefilled on the decode pod")
    assert list(completion.token_ids) == reference.tokens(list(prompt), MAX_TOKENS)
    assert counted_mismatches(metrics_url) >= before + 1


def test_pinning_such_a_prompt_to_the_chain_is_refused_with_the_cause(mixed_cluster, reference):
    _, client, _ = mixed_cluster
    prompt = tuple(long_prompt_ids(reference.tokenizer, CHAIN_THRESHOLD_TOKENS + 40))
    with pytest.raises(grpc.RpcError) as refused:
        client.generate(GenerateRequest(token_ids=prompt, sampling=greedy(MAX_TOKENS),
                                        prefill_route="chain"), timeout_s=60)
    assert refused.value.code() is grpc.StatusCode.UNAVAILABLE
    assert "prefill_route chain, but no live chain ships KV" in refused.value.details()
    assert MISMATCH in refused.value.details()
