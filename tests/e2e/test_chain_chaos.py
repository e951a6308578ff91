"""A chain's death never fails a request: the service as real processes (one decode pod, a
2-rank chain, supervised as `baton up` supervises it), 8 or 16 long prompts sent at once through
the chain, and one chain rank killed with SIGKILL at a moment of the burst: while most of
them wait at rank 0, while the chain computes and pushes the first ones, or when the last
ones are in flight. Every request ends served with the fault-free tokens (greedy, KV
compression off): an automatic one is prefilled again on the decode pod (or keeps the
stream it had), a pinned one waits for the restarted chain and goes through it again.

Which moment a kill hits depends on this machine's speed, so each case kills at a point of
the burst it can observe (how many streams have their first token), and the cases
together cover the queue, the chain's work and its pushes; each case checks that the kill
really failed some requests over.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

import pytest
from baton.api.requests import CompressionParams, GenerateRequest
from baton.client import BatonClient
from baton.local.cluster import LocalCluster
from baton.local.spec import ClusterSpec
from baton.routing.redis_store import RedisStore
from e2e_cluster import (
    CHAIN_THRESHOLD_TOKENS,
    WORKER_TTL_S,
    MonolithicReference,
    greedy,
    skip_without_cluster_parts,
    supervised,
    wait_until,
)

pytestmark = pytest.mark.slow
NUM_PROMPTS = 8  # a burst; twice as many where the kill waits for first tokens (see CASES)
MAX_TOKENS = 12
# A killed chain restarts and registers within this long, even on a machine running a second
# test suite beside this one (loading the model is most of it); pinned requests wait as long.
CHAIN_BACK_S = 120.0


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    skip_without_cluster_parts()
    spec = ClusterSpec(decode_workers=1, chain_ranks=2, prefill_threshold_tokens=CHAIN_THRESHOLD_TOKENS,
                       chain_break_even=False, heartbeat_s=0.5, worker_ttl_s=WORKER_TTL_S,
                       extra_args={"gateway": ["--gateway-reroute-wait-s", str(CHAIN_BACK_S)]})
    with LocalCluster(spec, log_dir=tmp_path_factory.mktemp("chain-chaos-logs")) as cluster, \
            supervised(cluster):
        BatonClient(cluster.gateway_address).wait_until_serving(timeout_s=30)
        yield cluster


# The first tokens a client sees lag the chain's pushes (on a loaded machine by several
# prompts): with bursts of 8, kills after 4 and after 2 first tokens were each seen to come
# when the chain had pushed them all, so a case that waits for first tokens sends 16, a
# second of the chain's work.
CASES = [  # (the rank killed, after how many first tokens, the requests' prefill_route)
    ("prefill-1", 0, "auto"),  # the tail, with every request queued or in the chain
    ("prefill-0", 2, "auto"),  # rank 0, with a few pushed and the rest queued or computing
    ("prefill-1", 1, "auto"),  # the tail, with the first pushed and the rest on their way
    ("prefill-0", 0, "chain"),  # pinned: every request waits for the restarted chain
    ("prefill-1", 1, "chain"),  # pinned, one already streaming: the rest go through it again
]


@pytest.fixture(scope="module")
def prompts():
    """For each case, 8 or 16 prompts of 750-900 tokens of real Python source (each case its
    own, each prompt from its own offset: a prompt served before sits in the decode pod's
    prefix cache, and the cache-aware route would not send it to the chain again), and their
    fault-free tokens."""
    reference = MonolithicReference()
    source = reference.tokenizer.encode(Path(os.__file__).read_text())
    sizes = [2 * NUM_PROMPTS if kill_after else NUM_PROMPTS for _, kill_after, _ in CASES]
    starts = [sum(sizes[:case]) for case in range(len(CASES))]
    sets = [[source[(starts[case] + i) * 100:][:750 + 10 * i] for i in range(size)]
            for case, size in enumerate(sizes)]
    results = reference.engine.generate([p for prompts in sets for p in prompts], greedy(MAX_TOKENS))
    tokens = [result.token_ids for result in results]
    return [(prompts, tokens[starts[case]:starts[case] + len(prompts)])
            for case, prompts in enumerate(sets)]


def chain_incarnation(cluster) -> str:
    """The registered chain's incarnation ("" while none is registered)."""
    store = RedisStore(cluster.redis_url)
    try:
        chains = store.list_workers("prefill")
    finally:
        store.close()
    return chains[0].incarnation if chains else ""


class Burst:
    """Every prompt streamed at once through the gateway, each on its own thread."""

    def __init__(self, address: str, prompts: list[list[int]], route: str) -> None:
        self.tokens: list[list[int]] = [[] for _ in prompts]
        self.errors: list[str] = []
        self._threads = [threading.Thread(target=self._one, args=(address, prompt, index, route),
                                          daemon=True) for index, prompt in enumerate(prompts)]
        for thread in self._threads:
            thread.start()

    def _one(self, address: str, prompt: list[int], index: int, route: str) -> None:
        client = BatonClient(address)
        try:
            request = GenerateRequest(token_ids=tuple(prompt), sampling=greedy(MAX_TOKENS),
                                      compression=CompressionParams(enabled=False),
                                      prefill_route=route)
            for step in client.stream(request, timeout_s=180):
                self.tokens[index] += step.token_ids
        except Exception as e:  # noqa: BLE001 - reported by the test
            self.errors.append(f"request {index}: {e!r}")
        finally:
            client.close()

    def started(self) -> int:
        """How many streams have their first token."""
        return sum(bool(tokens) for tokens in self.tokens)

    def join(self) -> None:
        for thread in self._threads:
            thread.join(200)


@pytest.mark.parametrize("case", range(len(CASES)), ids=["-".join(map(str, c)) for c in CASES])
def test_a_chain_rank_killed_mid_burst_fails_no_request(cluster, prompts, case):
    victim, kill_after_first_tokens, route = CASES[case]
    everything, expected = prompts[case]
    # the chain an earlier case killed is back (the supervisor restarted it)
    wait_until(lambda: chain_incarnation(cluster) != "", CHAIN_BACK_S, "a registered chain")
    before = chain_incarnation(cluster)
    failed_over = cluster.child("gateway").log_tail(1_000_000).count("failed it")

    burst = Burst(cluster.gateway_address, everything, route)
    # The chain takes a prompt every ~50-100 ms here: look often, or the moment is gone.
    deadline = time.monotonic() + 60
    while burst.started() < kill_after_first_tokens and not burst.errors:
        assert time.monotonic() < deadline, f"no {kill_after_first_tokens} first tokens in 60 s"
        time.sleep(0.002)
    os.kill(cluster.child(victim).process.pid, signal.SIGKILL)
    burst.join()

    assert burst.errors == []
    assert burst.tokens == expected
    gateway_log = cluster.child("gateway").log_tail(1_000_000)
    assert gateway_log.count("failed it") > failed_over, "the kill failed no request over"
    # The chain comes back (the supervisor restarts it) before the next case.
    wait_until(lambda: chain_incarnation(cluster) not in ("", before), CHAIN_BACK_S,
               "the restarted chain")
