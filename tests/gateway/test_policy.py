"""The least-loaded routing policy over routing snapshots: decode pick, chains, fallbacks."""

from __future__ import annotations

import dataclasses

import pytest
from baton.config import GatewayRoutingConfig
from baton.gateway.routing_policy import InFlight, NoLiveWorkers, WorkersFull, create_policy
from baton.kv.contract import HEADS_COMPLETE, KVContract
from baton.routing import RoutingSnapshot, WorkerInfo, WorkerLoad

MODEL = "tiny"


def decode(name: str, free: int = 100, running: int = 0, queued_tokens: int = 0,
           model: str = MODEL) -> WorkerInfo:
    return WorkerInfo(worker_id=name, role="decode", address=f"{name}:1", model_id=model,
                      model_revision=model, version="dev",
                      load=WorkerLoad(free_kv_blocks=free, total_kv_blocks=100,
                                      running_sequences=running, queued_prompt_tokens=queued_tokens))


def rank(chain: str, index: int, queued_tokens: int = 0, num_ranks: int = 2,
         break_even: int = 0) -> WorkerInfo:
    return WorkerInfo(worker_id=f"{chain}-{index}", role="prefill", address=f"{chain}-{index}:1",
                      model_id=MODEL, model_revision=MODEL, version="dev", chain_id=chain,
                      rank=index, num_ranks=num_ranks, break_even_tokens=break_even,
                      load=WorkerLoad(queued_prompt_tokens=queued_tokens))


def snapshot(*workers: WorkerInfo) -> RoutingSnapshot:
    return RoutingSnapshot(workers=tuple(workers), read_at=1.0, stale=False)


@pytest.fixture
def policy():
    return create_policy(GatewayRoutingConfig(prefill_threshold_tokens=100, policy="least-loaded"), MODEL)


def test_the_decode_pod_with_the_fewest_sequences_wins_then_queued_tokens_then_free_blocks(policy):
    workers = snapshot(decode("a", running=3), decode("b", running=1, queued_tokens=50),
                       decode("c", running=1, queued_tokens=10, free=5),
                       decode("d", running=1, queued_tokens=10, free=50))
    assert policy.route(10, workers, {}).decode.worker_id == "d"


def test_in_flight_requests_spread_a_burst_between_heartbeats(policy):
    workers = snapshot(decode("a"), decode("b"))
    first = policy.route(10, workers, {}).decode
    second = policy.route(10, workers, {first.address: InFlight(requests=1, prompt_tokens=10)})
    assert {first.worker_id, second.decode.worker_id} == {"a", "b"}


def test_full_pods_are_skipped_and_all_full_is_workers_full(policy):
    assert policy.route(10, snapshot(decode("a", free=0), decode("b", free=1, running=9)),
                        {}).decode.worker_id == "b"
    with pytest.raises(WorkersFull, match="all 2 decode workers"):
        policy.route(10, snapshot(decode("a", free=0), decode("b", free=0)), {})


def test_no_decode_pod_of_this_model_is_no_live_workers(policy):
    with pytest.raises(NoLiveWorkers, match="no decode worker of model 'tiny'"):
        policy.route(10, snapshot(decode("a", model="other"), rank("c0", 0)), {})


def test_short_prompts_stay_local_and_long_ones_take_the_least_queued_chain(policy):
    workers = snapshot(decode("a"), rank("c0", 0, queued_tokens=900),
                       rank("c1", 0, queued_tokens=100))
    assert policy.route(99, workers, {}).chain is None
    chosen = policy.route(100, workers, {}).chain
    assert chosen.chain_id == "c1" and chosen.rank == 0
    busy_here = {"c1-0:1": InFlight(requests=2, prompt_tokens=2000)}
    assert policy.route(100, workers, busy_here).chain.chain_id == "c0"


def test_with_no_live_chain_a_long_prompt_is_prefilled_on_the_decode_pod(policy):
    workers = snapshot(decode("a"), rank("c0", 1))  # a rank that is not a chain's head
    decision = policy.route(500, workers, {})
    assert decision.chain is None and decision.decode.worker_id == "a"


def test_a_long_prompt_is_prefilled_on_the_decode_pod_while_every_chain_is_backed_up():
    policy = create_policy(GatewayRoutingConfig(prefill_threshold_tokens=100,
                                                chain_max_queued_tokens=1000), MODEL)
    idle, busy = rank("c0", 0), rank("c0", 0, queued_tokens=700)
    assert policy.route(900, snapshot(decode("a"), idle), {}).chain is not None  # alone: fits
    assert policy.route(200, snapshot(decode("a"), busy), {}).chain is not None  # 900 <= 1000
    assert policy.route(400, snapshot(decode("a"), busy), {}).chain is None  # 1100 > 1000
    queued_here = {"c0-0:1": InFlight(requests=2, prompt_tokens=950)}
    assert policy.route(100, snapshot(decode("a"), idle), queued_here).chain is None
    unlimited = create_policy(GatewayRoutingConfig(prefill_threshold_tokens=100,
                                                   chain_max_queued_tokens=0), MODEL)
    assert unlimited.route(400, snapshot(decode("a"), busy), queued_here).chain is not None


def test_an_unknown_policy_name_is_a_value_error():
    config = GatewayRoutingConfig()
    config.policy = "random"
    with pytest.raises(ValueError, match="'random'"):
        create_policy(config, MODEL)


@pytest.mark.parametrize("setting, value", [("chain_max_queued_tokens", -1), ("policy", "random"),
                                            ("kv_wait_s", 0.0), ("stall_s", float("nan"))])
def test_the_routing_settings_refuse_a_bad_value_naming_it(setting, value):
    with pytest.raises(ValueError, match=f"gateway {setting}"):
        GatewayRoutingConfig(**{setting: value})


def test_a_pinned_prefill_route_overrides_length_and_load_and_says_so(policy):
    workers = snapshot(decode("a"), rank("c0", 0, queued_tokens=1_000_000))
    local = policy.route(5000, workers, {}, prefill_route="local")
    assert local.chain is None and local.reason == "prefill_route local: prefilled on the decode pod"
    chain = policy.route(5, workers, {}, prefill_route="chain")  # short and backed up: still the chain
    assert chain.chain.chain_id == "c0" and chain.reason == "prefill_route chain: chain c0"
    with pytest.raises(NoLiveWorkers, match="prefill_route chain"):
        policy.route(5, snapshot(decode("a")), {}, prefill_route="chain")


def test_every_automatic_decision_names_its_reason(policy):
    assert "< prefill_threshold_tokens 100" in policy.route(99, snapshot(decode("a")), {}).reason
    assert policy.route(100, snapshot(decode("a")), {}).reason.endswith(
        ": no chain of model 'tiny' is live: prefilled on the decode pod")
    assert policy.route(100, snapshot(decode("a"), rank("c0", 0)), {}).reason.endswith("chain c0")


def test_a_chain_takes_only_prompts_that_reach_its_measured_break_even(policy):
    workers = snapshot(decode("a"), rank("c0", 0, break_even=8192),
                       rank("c1", 0, queued_tokens=1000, break_even=2048))
    short = policy.route(1000, workers, {})
    assert short.chain is None and short.decode.worker_id == "a"
    assert short.reason == ("prompt of 1000 tokens >= prefill_threshold_tokens 100: below the "
                            "break-even of every chain (chain c1: 2048 tokens, measured in its "
                            "partition table): prefilled on the decode pod")
    assert policy.route(2048, workers, {}).chain.chain_id == "c1", "c0 does not pay yet, however idle"
    assert policy.route(8192, workers, {}).chain.chain_id == "c0", "both pay: the less queued"
    assert policy.route(5, workers, {}, prefill_route="chain").chain is not None, "a pin overrides it"
    threshold_only = create_policy(GatewayRoutingConfig(prefill_threshold_tokens=100,
                                                        chain_break_even=False), MODEL)
    assert threshold_only.route(1000, workers, {}).chain.chain_id == "c0"


def test_a_chain_takes_only_prompts_whose_decode_pod_accepts_its_cache(policy):
    # A decode pod refuses a cache of another model revision or dtype (FAILED_PRECONDITION):
    # during a revision's rollout, or on pods that resolved dtype auto differently, a long
    # prompt goes to a chain whose cache the picked pod takes, or is prefilled there.
    pod = dataclasses.replace(decode("a"), kv_dtype="float32")
    new_revision = dataclasses.replace(rank("c0", 0), model_revision="rev-2")
    bf16 = dataclasses.replace(rank("c1", 0), kv_dtype="bfloat16")
    decision = policy.route(500, snapshot(pod, new_revision, bf16), {})
    assert decision.chain is None and decision.reason == (
        "prompt of 500 tokens >= prefill_threshold_tokens 100: no live chain ships KV decode "
        "pod a:1 takes (chain c0 skipped: model revision 'rev-2' != 'tiny'; chain c1 skipped: "
        "kv dtype bfloat16 != float32): prefilled on the decode pod")
    with pytest.raises(NoLiveWorkers, match="prefill_route chain, but no live chain ships KV"):
        policy.route(5, snapshot(pod, new_revision, bf16), {}, prefill_route="chain")
    fp32 = dataclasses.replace(rank("c2", 0, queued_tokens=900), kv_dtype="float32")
    unsaid = rank("c3", 0, queued_tokens=1000)  # a record without a dtype: any
    assert policy.route(500, snapshot(pod, new_revision, bf16, fp32), {}).chain.chain_id == "c2"
    assert policy.route(500, snapshot(pod, unsaid), {}).chain.chain_id == "c3"


def contract(**changes) -> KVContract:
    return dataclasses.replace(KVContract(MODEL, MODEL, dtype="float32", num_layers=4, num_kv_heads=2,
                                          head_dim=8, layout=HEADS_COMPLETE,
                                          compression="pyramid keep_ratio 0.5"), **changes)


def test_published_contracts_decide_which_chain_a_decode_pod_is_paired_with():
    skipped = []
    policy = create_policy(GatewayRoutingConfig(prefill_threshold_tokens=100, policy="least-loaded"),
                           MODEL, skipped.append)
    pod = dataclasses.replace(decode("a"), kv_contract=contract(tensor_parallel_size=2, block_size=32))
    other_ratio = dataclasses.replace(rank("c0", 0), kv_contract=contract(
        compression="pyramid keep_ratio 0.3"))
    other_heads = dataclasses.replace(rank("c1", 0), kv_contract=contract(num_kv_heads=4))
    fits = dataclasses.replace(rank("c2", 0, queued_tokens=900), kv_contract=contract())
    decision = policy.route(500, snapshot(pod, other_ratio, other_heads, fits), {})
    assert decision.chain.chain_id == "c2", "another TP size and block size on the pod: it fits"
    assert decision.reason == (
        "prompt of 500 tokens >= prefill_threshold_tokens 100: chain c2 (chain c0 skipped: "
        "compression pyramid keep_ratio 0.3 != pyramid keep_ratio 0.5; chain c1 skipped: "
        "num kv heads 4 != 2)")
    assert skipped == [2]
    assert policy.route(500, snapshot(pod, fits), {}).reason.endswith(": chain c2")
    assert skipped == [2], "nothing passed over, nothing counted"


def test_a_prompt_pinned_to_a_chain_goes_to_a_decode_pod_the_chain_fits(policy):
    idle_fp32 = dataclasses.replace(decode("a"), kv_contract=contract())
    busy_bf16 = dataclasses.replace(decode("b", running=5), kv_contract=contract(dtype="bfloat16"))
    chain = dataclasses.replace(rank("c0", 0), kv_contract=contract(dtype="bfloat16"))
    workers = snapshot(idle_fp32, busy_bf16, chain)
    assert policy.route(500, workers, {}).chain is None, "unpinned: the idle pod prefills it"
    pinned = policy.route(500, workers, {}, prefill_route="chain")
    assert (pinned.decode.worker_id, pinned.chain.chain_id) == ("b", "c0")
