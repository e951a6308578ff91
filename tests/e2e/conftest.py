"""One local cluster (real processes, a real redis-server, the gateway's gRPC and HTTP APIs)
shared by the end-to-end tests of the session."""

from __future__ import annotations

import pytest
from baton.client import BatonClient
from baton.local.cluster import LocalCluster
from baton.local.spec import ClusterSpec
from baton.serving import free_port
from e2e_cluster import (
    CHAIN_THRESHOLD_TOKENS,
    WORKER_TTL_S,
    MonolithicReference,
    skip_without_cluster_parts,
)


@pytest.fixture(scope="session")
def cluster(tmp_path_factory):
    skip_without_cluster_parts()
    spec = ClusterSpec(decode_workers=2, chain_ranks=2,
                       prefill_threshold_tokens=CHAIN_THRESHOLD_TOKENS,
                       chain_break_even=False,  # the chain's measured break-even is past the
                       # shipped model's context: the threshold alone sends prompts to the chain
                       heartbeat_s=0.5, worker_ttl_s=WORKER_TTL_S, gateway_http_port=free_port(),
                       decode_http=True)  # each decode pod's own door too (test_decode_door)
    with LocalCluster(spec, log_dir=tmp_path_factory.mktemp("cluster-logs")) as running:
        yield running


@pytest.fixture(scope="session")
def client(cluster):
    client = BatonClient(cluster.gateway_address)
    client.wait_until_serving(timeout_s=30)
    yield client
    client.close()


@pytest.fixture(scope="session")
def reference():
    return MonolithicReference()


@pytest.fixture(scope="session")
def api(cluster):
    """The real `openai` client of the cluster's HTTP door."""
    import openai

    client = openai.OpenAI(base_url=cluster.gateway_http_url, api_key="unused", max_retries=0,
                           timeout=120)
    yield client
    client.close()


@pytest.fixture(scope="session")
def model_id(api):
    (model,) = api.models.list().data
    return model.id
