"""Decode pods of two tensor-parallel ranks in a `baton up` cluster (gloo, fp32): the local
route and the chain's route (a chain of one process per rank shipping its KV to a pod of two)
give the tokens one process gives, with compression off and on (PyramidInfer's defaults); and
a rank killed inside a pod's group takes that pod down, its streams move to the other pod,
every stream completes with the same tokens, and the supervisor brings the pod back."""

from __future__ import annotations

import os
import re
import signal
from pathlib import Path

import pytest
from baton.api.requests import CompressionParams, GenerateRequest
from baton.client import BatonClient
from baton.config import KVPoolConfig, PyramidConfig
from baton.local.cluster import LocalCluster
from baton.local.spec import ClusterSpec
from baton.model.hub import SHIPPED_MODEL_DIR
from baton.model.loader import load_checkpoint
from baton.pyramid.engine_hook import engine_compressor_factory
from baton.sarathi.engine import Engine
from e2e_cluster import (
    CHAIN_THRESHOLD_TOKENS,
    WORKER_TTL_S,
    MonolithicReference,
    greedy,
    long_prompt_ids,
    skip_without_cluster_parts,
    supervised,
    wait_until,
    worker_load,
)
from test_chaos import MAX_TOKENS as STREAM_TOKENS
from test_chaos import Streams

pytestmark = pytest.mark.slow
MAX_TOKENS = 24
NO_COMPRESSION = CompressionParams(enabled=False)
FP32 = ["--model-dtype", "float32"]


@pytest.fixture(scope="module")
def tp_cluster(tmp_path_factory):
    skip_without_cluster_parts()
    spec = ClusterSpec(decode_workers=2, chain_ranks=2, decode_tensor_parallel_size=2,
                       prefill_threshold_tokens=CHAIN_THRESHOLD_TOKENS, chain_break_even=False,
                       heartbeat_s=0.5, worker_ttl_s=WORKER_TTL_S,
                       extra_args={"decode": FP32, "prefill": FP32})
    with LocalCluster(spec, log_dir=tmp_path_factory.mktemp("tp-logs")) as cluster, \
            supervised(cluster) as restarts:
        BatonClient(cluster.gateway_address).wait_until_serving(timeout_s=60)
        yield cluster, restarts


@pytest.fixture(scope="module")
def reference():
    return MonolithicReference()


@pytest.fixture(scope="module")
def compressing_engine():
    """One process with the deployment's compression (the pods run PyramidConfig's defaults)."""
    loaded = load_checkpoint(SHIPPED_MODEL_DIR, dtype="float32", device="cpu")
    return Engine(loaded.model, loaded.tokenizer, kv=KVPoolConfig(num_blocks=512),
                  compressor_factory=engine_compressor_factory(PyramidConfig(), loaded.config))


def test_both_routes_equal_one_process(tp_cluster, reference, compressing_engine):
    cluster, _ = tp_cluster
    short = reference.tokenizer.encode("def fibonacci(n):\n")
    long = long_prompt_ids(reference.tokenizer, CHAIN_THRESHOLD_TOKENS + 60)
    client = BatonClient(cluster.gateway_address)
    try:
        for prompt, route in ((short, "local"), (long, "chain"), (long, "local")):
            completion = client.generate(GenerateRequest(
                token_ids=tuple(prompt), sampling=greedy(MAX_TOKENS), compression=NO_COMPRESSION,
                prefill_route=route), timeout_s=120)
            assert bool(completion.last.route.chain_id) == (route == "chain")
            assert list(completion.token_ids) == reference.tokens(prompt, MAX_TOKENS), route
            compressed = client.generate(GenerateRequest(
                token_ids=tuple(prompt), sampling=greedy(MAX_TOKENS), prefill_route=route),
                timeout_s=120)
            want = compressing_engine.generate([list(prompt)], greedy(MAX_TOKENS))[0].token_ids
            assert list(compressed.token_ids) == want, f"{route}, compressed"
    finally:
        client.close()


def followers_of(pid: int) -> list[int]:
    """The tensor-parallel followers a decode pod started."""
    children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    return [int(child) for child in children
            if b"baton.parallel.follower" in Path(f"/proc/{child}/cmdline").read_bytes()]


def test_a_rank_killed_inside_a_group_loses_no_stream(tp_cluster, reference):
    cluster, restarts = tp_cluster
    source = long_prompt_ids(reference.tokenizer, CHAIN_THRESHOLD_TOKENS + 100)
    prompts = [source[index * 3:index * 3 + 40] for index in range(6)]
    expected = [reference.tokens(prompt, STREAM_TOKENS) for prompt in prompts]
    streams = Streams(cluster.gateway_address, prompts, first_index=100)  # all greedy
    streams.wait_for_tokens(2, streams=3)
    pods = []  # the pod that holds the most of them (routing need not spread them)
    for name in ("decode-0", "decode-1"):
        address = re.findall(r"decode pod (\S+) serves", cluster.child(name).log_path.read_text())[-1]
        pods.append((worker_load(cluster, address, "decode").running_sequences, name, address))
    _, victim, address = max(pods)
    failed = f"decode pod {address} failed after"
    moves_before = cluster.child("gateway").log_tail(1_000_000).count(failed)
    (follower,) = followers_of(cluster.child(victim).process.pid)
    os.kill(follower, signal.SIGKILL)
    streams.join()
    assert not streams.errors
    assert streams.tokens == expected
    assert cluster.child("gateway").log_tail(1_000_000).count(failed) > moves_before, \
        "no stream was on the pod whose rank was killed"
    # the pod whose group broke exited (its leader notices at its next message, a keepalive
    # when idle, then the supervisor backs off): the supervisor started it again
    wait_until(lambda: any(victim in restart for restart in restarts), 120, f"{victim}'s restart")
