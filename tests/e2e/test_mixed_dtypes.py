"""Pods that resolved different dtypes (`dtype auto` on nodes of mixed CPUs, or a setting
given to one role only): here the decode pod computes fp32 and the chain bf16. A decode pod
refuses a cache of another dtype, so the gateway sends the chain no prompt for that pod: a
long prompt is prefilled on the decode pod, says why, and gives the fault-free tokens; one
pinned to the chain is refused with the cause instead of failing after a refused push."""

from __future__ import annotations

import grpc
import pytest
from baton.api.requests import CompressionParams, GenerateRequest
from baton.client import BatonClient
from baton.local.cluster import LocalCluster
from baton.local.spec import ClusterSpec
from e2e_cluster import CHAIN_THRESHOLD_TOKENS, greedy, long_prompt_ids, skip_without_cluster_parts

pytestmark = pytest.mark.slow
MAX_TOKENS = 8


@pytest.fixture(scope="module")
def mixed_client(tmp_path_factory):
    skip_without_cluster_parts()
    spec = ClusterSpec(decode_workers=1, chain_ranks=2, prefill_threshold_tokens=CHAIN_THRESHOLD_TOKENS,
                       chain_break_even=False, heartbeat_s=0.5,
                       extra_args={"decode": ["--model-dtype", "float32"],
                                   "prefill": ["--model-dtype", "bfloat16"],
                                   "gateway": ["--gateway-reroute-wait-s", "1"]})
    with LocalCluster(spec, log_dir=tmp_path_factory.mktemp("mixed-logs")) as cluster:
        client = BatonClient(cluster.gateway_address)
        client.wait_until_serving(timeout_s=30)
        yield client
        client.close()


def test_a_long_prompt_stays_on_a_decode_pod_that_would_refuse_the_chains_cache(mixed_client,
                                                                                 reference):
    prompt = tuple(long_prompt_ids(reference.tokenizer, CHAIN_THRESHOLD_TOKENS + 40))
    completion = mixed_client.generate(GenerateRequest(
        token_ids=prompt, sampling=greedy(MAX_TOKENS), compression=CompressionParams(enabled=False)),
        timeout_s=60)
    route = completion.last.route
    assert not route.chain_id
    assert "no live chain computes a cache decode pod" in route.reason
    assert "KV dtype float32" in route.reason
    assert list(completion.token_ids) == reference.tokens(list(prompt), MAX_TOKENS)


def test_pinning_such_a_prompt_to_the_chain_is_refused_with_the_cause(mixed_client, reference):
    prompt = tuple(long_prompt_ids(reference.tokenizer, CHAIN_THRESHOLD_TOKENS + 40))
    with pytest.raises(grpc.RpcError) as refused:
        mixed_client.generate(GenerateRequest(token_ids=prompt, sampling=greedy(MAX_TOKENS),
                                              prefill_route="chain"), timeout_s=60)
    assert refused.value.code() is grpc.StatusCode.UNAVAILABLE
    assert "prefill_route chain, but no live chain computes a cache" in refused.value.details()
