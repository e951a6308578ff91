"""Scheduling as the SARATHI paper states it, on the real scheduler and KV pool (no model:
each iteration's KV writes and sampled tokens are simulated, time is counted in iterations)."""

from __future__ import annotations

import pytest
import torch
from baton.config import SchedulerConfig
from baton.kv import KVPool, LayerKV
from baton.sampling.params import SamplingParams
from baton.sampling.stops import StopStringMatcher
from baton.sarathi.memory import KVManager
from baton.sarathi.request import Sequence, Status
from baton.sarathi.scheduler import POLICIES, Scheduler, SchedulerOutput, create_scheduler

NUM_LAYERS = 2


def make_scheduler(policy: str = "sarathi", token_budget: int = 64, tile_size: int = 0,
                   num_blocks: int = 4096, block_size: int = 16, max_running: int = 64) -> Scheduler:
    pool = KVPool(NUM_LAYERS, num_kv_heads=1, head_dim=2, block_size=block_size, num_blocks=num_blocks)
    config = SchedulerConfig(policy=policy, token_budget=token_budget, tile_size=tile_size,
                             max_running=max_running)
    return create_scheduler(config, KVManager(pool))


def new_sequence(index: int, prompt_length: int) -> Sequence:
    return Sequence(f"seq-{index}", [1] * prompt_length, SamplingParams(max_tokens=10_000), arrival=index,
                    sampler=None, decoder=None, stop_matcher=StopStringMatcher([]))


def iterate(scheduler: Scheduler) -> SchedulerOutput:
    """One iteration: plan, write the planned tokens' KV, advance, sample a token where due."""
    plan = scheduler.schedule()
    pool = scheduler.memory.pool
    work = [(chunk.seq, chunk.num_tokens) for chunk in plan.prefills] + [(s, 1) for s in plan.decodes]
    sampling = [chunk.seq for chunk in plan.prefills if chunk.completes] + plan.decodes
    for seq, num_tokens in work:
        for layer in range(NUM_LAYERS):
            pool.append(seq.request_id, layer, torch.zeros(num_tokens, 1, 2), torch.zeros(num_tokens, 1, 2),
                        torch.arange(seq.num_computed, seq.num_computed + num_tokens))
    scheduler.update(plan)
    for seq in sampling:
        seq.output_ids.append(0)
    return plan


def with_running_decodes(scheduler: Scheduler, count: int) -> list[Sequence]:
    running = [new_sequence(i, 3) for i in range(count)]
    for seq in running:
        scheduler.add(seq)
    while len(scheduler.running) < count:
        iterate(scheduler)
    return running


def test_chunk_is_budget_minus_running_decodes():
    """Budget C with B-1 running decodes: the prefill chunk is C-(B-1) (SARATHI's 256-(B-1))."""
    scheduler = make_scheduler(token_budget=256)
    with_running_decodes(scheduler, 17)
    scheduler.add(new_sequence(100, 1000))
    chunks = []
    while scheduler.waiting or scheduler.prefilling:
        plan = iterate(scheduler)
        assert len(plan.decodes) == 17
        chunks.append(plan.num_prefill_tokens)
    assert chunks == [256 - 17] * 4 + [1000 - 4 * 239]


def test_short_prompts_share_the_rest_of_the_budget():
    """A prompt that ends inside the budget leaves the rest to the next one (Sarathi-Serve)."""
    scheduler = make_scheduler(token_budget=64)
    with_running_decodes(scheduler, 3)
    for index in range(3):
        scheduler.add(new_sequence(100 + index, 25))
    plan = iterate(scheduler)
    assert [chunk.num_tokens for chunk in plan.prefills] == [25, 25, 11]
    assert [chunk.completes for chunk in plan.prefills] == [True, True, False]
    assert plan.num_tokens == 64


def test_tile_size_rounds_chunk_plus_decodes_to_whole_tiles():
    scheduler = make_scheduler(token_budget=100, tile_size=32)
    with_running_decodes(scheduler, 5)
    scheduler.add(new_sequence(100, 1000))
    plan = iterate(scheduler)
    assert plan.num_prefill_tokens == 96 - 5
    assert plan.num_tokens % 32 == 0


def prefill_long_prompt_beside_decodes(policy: str) -> tuple[list[SchedulerOutput], list[Sequence]]:
    scheduler = make_scheduler(policy, token_budget=128)
    running = with_running_decodes(scheduler, 8)
    scheduler.add(new_sequence(100, 2000))
    plans = []
    while scheduler.waiting or scheduler.prefilling or not plans:
        plans.append(iterate(scheduler))
    plans.append(iterate(scheduler))  # the long prompt's first decode
    return plans, running


def test_sarathi_never_starves_decodes_while_a_long_prompt_prefills():
    plans, running = prefill_long_prompt_beside_decodes("sarathi")
    assert len(plans) > 10, "the prompt is prefilled over many iterations"
    for plan in plans:
        assert set(running) <= set(plan.decodes), "every running decode gets a token every iteration"
        # Time between tokens is one iteration of at most the budget: bounded by C, not the prompt.
        assert plan.num_tokens <= 128


def test_separate_phases_stall_decodes_for_the_whole_prefill():
    plans, _ = prefill_long_prompt_beside_decodes("separate")
    prefill_only = [p for p in plans if p.prefills]
    assert len(prefill_only) == 1 and prefill_only[0].decodes == []
    assert prefill_only[0].num_tokens == 2000  # decodes wait out a 2000-token iteration


def test_orca_mixes_the_whole_prompt_into_one_decode_iteration():
    plans, running = prefill_long_prompt_beside_decodes("orca")
    mixed = [p for p in plans if p.prefills]
    assert len(mixed) == 1 and set(running) <= set(mixed[0].decodes)
    assert mixed[0].num_tokens == 2000 + 8  # that token of every decode costs a 2008-token iteration


def test_only_the_final_chunk_samples():
    scheduler = make_scheduler(token_budget=64)
    seq = new_sequence(0, 150)
    scheduler.add(seq)
    completes = [iterate(scheduler).prefills[0].completes for _ in range(3)]
    assert completes == [False, False, True]
    assert seq.output_ids == [0] and seq.status is Status.RUNNING


def test_admission_waits_for_kv_capacity():
    # 2 layers x 16-token blocks; 40 blocks hold 320 tokens per layer.
    scheduler = make_scheduler(token_budget=512, num_blocks=40)
    first, second = new_sequence(0, 300), new_sequence(1, 200)
    scheduler.add(first)
    scheduler.add(second)
    iterate(scheduler)
    assert scheduler.running == [first] and list(scheduler.waiting) == [second]
    for _ in range(3):
        iterate(scheduler)
    assert list(scheduler.waiting) == [second], "the pool cannot hold the second prompt yet"
    scheduler.remove(first)  # it finishes: its blocks are free at once
    iterate(scheduler)
    assert scheduler.running == [second]


def test_a_full_pool_preempts_the_newest_sequence_and_keeps_its_tokens():
    # 16 blocks: two sequences of 48 tokens x 2 layers take 12 blocks; growth needs more.
    scheduler = make_scheduler(token_budget=256, num_blocks=16)
    old, new = new_sequence(0, 47), new_sequence(1, 47)
    scheduler.add(old)
    scheduler.add(new)
    preempted = []
    for _ in range(40):
        preempted += iterate(scheduler).preempted
        if preempted:
            break
    assert preempted == [new]
    assert new.status is Status.WAITING and new.num_computed == 0 and new.output_ids
    assert scheduler.waiting[0] is new and not scheduler.memory.pool.has(new.request_id)
    assert old in scheduler.running


def test_max_running_caps_admission():
    scheduler = make_scheduler(token_budget=256, max_running=3)
    for index in range(5):
        scheduler.add(new_sequence(index, 4))
    for _ in range(6):
        iterate(scheduler)
    assert len(scheduler.running) == 3 and len(scheduler.waiting) == 2


def test_kv_from_a_chain_joins_the_running_set_directly():
    scheduler = make_scheduler()
    seq = new_sequence(0, 40)
    seq.output_ids, seq.num_computed = [7], 40
    seq.arrived_kv = [LayerKV(torch.zeros(n, 1, 2), torch.zeros(n, 1, 2), torch.arange(n)) for n in (40, 20)]
    scheduler.add(seq)
    plan = iterate(scheduler)
    assert plan.decodes == [seq] and not plan.prefills
    assert scheduler.memory.pool.lengths(seq.request_id) == [41, 21]


def test_policies_are_registered_and_bad_config_is_named():
    assert set(POLICIES) >= {"sarathi", "separate", "orca"}
    with pytest.raises(ValueError, match="'fifo'"):
        SchedulerConfig(policy="fifo")
    with pytest.raises(ValueError, match=r"token_budget must be 0 \(auto\) or >= 2, got 1"):
        SchedulerConfig(token_budget=1)
    with pytest.raises(ValueError, match="tile_size 512 exceeds token_budget 256"):
        SchedulerConfig(token_budget=256, tile_size=512)


def test_token_at_reads_the_prompt_then_the_output():
    seq = new_sequence(0, 3)
    seq.prompt_ids = [5, 6, 7]
    seq.output_ids += [8, 9]
    assert [seq.token_at(i) for i in range(seq.num_tokens)] == seq.token_ids == [5, 6, 7, 8, 9]


def test_waiting_prompts_are_admitted_by_priority_then_arrival():
    # vLLM's rule: a lower priority value goes first; equal ones keep their arrival order
    scheduler = make_scheduler(max_running=1)
    priorities = [0, 5, -1, 0, -1]
    for index, priority in enumerate(priorities):
        seq = new_sequence(index, 8)
        seq.params = SamplingParams(max_tokens=1, priority=priority)
        scheduler.add(seq)
    assert [seq.request_id for seq in scheduler.waiting] == ["seq-2", "seq-4", "seq-0", "seq-3",
                                                              "seq-1"]
    plan = scheduler.schedule()
    assert [chunk.seq.request_id for chunk in plan.prefills] == ["seq-2"]
