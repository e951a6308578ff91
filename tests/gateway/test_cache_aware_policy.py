"""The cache-aware routing policy: the pod holding a prompt's prefix wins while it is not
much busier, a chain takes only what no pod holds, the reason names the hit, tenants never
meet in the index."""

from __future__ import annotations

import pytest
from baton.config import GatewayRoutingConfig
from baton.gateway.routing_policy import InFlight, RoutedPrompt, create_policy
from baton.routing import InMemoryStore, RoutingSnapshot, WorkerInfo, WorkerLoad
from baton.routing.prefix_index import PrefixIndex, prompt_hashes

MODEL = "tiny"
BLOCK = 16
PROMPT = tuple(range(100, 400))  # 300 tokens: 18 full blocks


def decode(name: str, queued_tokens: int = 0, rate: float = 1000.0, running: int = 0) -> WorkerInfo:
    return WorkerInfo(worker_id=name, role="decode", address=f"{name}:1", model_id=MODEL,
                      model_revision=MODEL, version="dev", kv_dtype="float32", incarnation="i",
                      kv_block_size=BLOCK,
                      load=WorkerLoad(free_kv_blocks=100, total_kv_blocks=100, running_sequences=running,
                                      queued_prompt_tokens=queued_tokens, prefill_tokens_per_s=rate))


def chain_head(chain: str = "c1") -> WorkerInfo:
    return WorkerInfo(worker_id=f"{chain}-0", role="prefill", address=f"{chain}-0:1", model_id=MODEL,
                      model_revision=MODEL, version="dev", chain_id=chain, num_ranks=2,
                      kv_dtype="float32")


def cached(store: InMemoryStore, index: PrefixIndex, worker: WorkerInfo, tokens, salt: str = "") -> None:
    """The pod publishes that it holds ``tokens``' full blocks; the index reads it."""
    hashes = prompt_hashes(worker, list(tokens), salt)
    start = len(store.read_prefix_events(worker.prefix_stream, 0, 10_000))
    store.append_prefix_events(worker.prefix_stream,
                               [(start + i + 1, True, h) for i, h in enumerate(hashes)], ttl_s=60)


@pytest.fixture
def policy():
    return create_policy(GatewayRoutingConfig(prefill_threshold_tokens=200, chain_break_even=False),
                         MODEL)


def view(store, index, *workers) -> RoutingSnapshot:
    index.refresh(store, [w for w in workers if w.role == "decode"])
    return RoutingSnapshot(workers=tuple(workers), read_at=1.0, stale=False, prefixes=index)


def test_the_pod_holding_the_prefix_wins_and_the_reason_names_the_hit(policy):
    store, index = InMemoryStore(), PrefixIndex()
    a, b = decode("a"), decode("b", queued_tokens=50)
    cached(store, index, b, PROMPT[:160])
    decision = policy.route(len(PROMPT), view(store, index, a, b), {}, prompt=RoutedPrompt(PROMPT))
    assert decision.decode.worker_id == "b" and decision.chain is None
    assert "160 of 300 prompt tokens cached on b:1" in decision.reason
    assert decision.cached_tokens == 160  # the gateway counts only the rest as b's new work


def test_a_hot_prefix_on_a_swamped_pod_loses_to_an_idle_one(policy):
    store, index = InMemoryStore(), PrefixIndex()
    a, b = decode("a"), decode("b", queued_tokens=5000)
    cached(store, index, b, PROMPT)
    decision = policy.route(len(PROMPT), view(store, index, a, b), {}, prompt=RoutedPrompt(PROMPT))
    assert decision.decode.worker_id == "a"


def test_in_flight_prompt_tokens_count_as_queued(policy):
    store, index = InMemoryStore(), PrefixIndex()
    a, b = decode("a"), decode("b")
    cached(store, index, b, PROMPT[:32])
    busy = {b.address: InFlight(requests=3, prompt_tokens=2000)}
    assert policy.route(len(PROMPT), view(store, index, a, b), busy,
                        prompt=RoutedPrompt(PROMPT)).decode.worker_id == "a"


def test_a_chain_takes_only_what_no_pod_holds(policy):
    store, index = InMemoryStore(), PrefixIndex()
    a = decode("a")
    cold = policy.route(len(PROMPT), view(store, index, a, chain_head()), {}, prompt=RoutedPrompt(PROMPT))
    assert cold.chain is not None, "300 uncached tokens >= the threshold: the chain"
    cached(store, index, a, PROMPT[:200])
    warm = policy.route(len(PROMPT), view(store, index, a, chain_head()), {}, prompt=RoutedPrompt(PROMPT))
    assert warm.chain is None and "108 uncached tokens < prefill_threshold_tokens 200" in warm.reason  # 12 full blocks


def test_a_burst_sharing_a_prefix_lands_on_one_pod(policy):
    store, index = InMemoryStore(), PrefixIndex()
    a, b = decode("a"), decode("b")
    workers = view(store, index, a, b)
    first = policy.route(len(PROMPT), workers, {}, prompt=RoutedPrompt(PROMPT))
    follower = PROMPT[:288] + (7, 8, 9)
    second = policy.route(len(follower), workers, {}, prompt=RoutedPrompt(follower))
    assert second.decode.worker_id == first.decode.worker_id
    assert "288 of 291 prompt tokens cached" in second.reason


def test_tenants_never_share_an_entry(policy):
    store, index = InMemoryStore(), PrefixIndex()
    a, b = decode("a"), decode("b", queued_tokens=10)
    cached(store, index, b, PROMPT, salt="tenant-a")
    decision = policy.route(len(PROMPT), view(store, index, a, b), {},
                            prompt=RoutedPrompt(PROMPT, cache_salt="tenant-b"))
    assert decision.decode.worker_id == "a" and decision.reason.startswith("prompt of 300 tokens")


def test_a_chain_routed_prompt_is_expected_on_its_pod_only_when_its_kv_stays_whole(policy):
    store, index = InMemoryStore(), PrefixIndex()
    a, b = decode("a"), decode("b")
    workers = view(store, index, a, b, chain_head())
    pruned = policy.route(len(PROMPT), workers, {}, prompt=RoutedPrompt(PROMPT))
    assert pruned.chain is not None
    again = policy.route(len(PROMPT), workers, {}, prompt=RoutedPrompt(PROMPT))
    assert again.chain is not None, "a compressed cache from a chain is not cached: nothing to expect"
    other = PROMPT[::-1]
    whole = policy.route(len(other), workers, {}, prompt=RoutedPrompt(other, whole_kv=True))
    assert whole.chain is not None
    follower = policy.route(len(other), workers, {}, prompt=RoutedPrompt(other, whole_kv=True))
    assert follower.chain is None and follower.decode.worker_id == whole.decode.worker_id
