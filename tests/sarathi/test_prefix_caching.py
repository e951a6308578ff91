"""The prefix cache inside the engine: greedy tokens with hits equal those without, in fp32;
bf16 stays as close to the fp32 truth with a hit as without; hits never cross tenants or
model revisions; the token budget counts only the tokens computed."""

from __future__ import annotations

import pytest
import torch
from baton.config import PyramidConfig
from baton.kv import KVPool
from baton.pyramid import engine_compressor_factory
from baton.sampling.params import SamplingParams
from baton.sarathi.memory import KVManager
from baton.sarathi.request import Sequence, Status
from baton.sarathi.runner import ModelRunner
from baton.sarathi.scheduler import PrefillChunk, SchedulerOutput
from engine_fixtures import build_model, make_engine, prompts_of_lengths

GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
BLOCK = 4


def shared_prefix_prompts(prefix_length: int, *suffix_lengths: int, seed: int = 7) -> list[list[int]]:
    prefix, *suffixes = prompts_of_lengths(prefix_length, *suffix_lengths, seed=seed)
    return [prefix + suffix for suffix in suffixes]


def alone_without_cache(model, prompts, params=GREEDY, **engine_kwargs) -> list[list[int]]:
    return [make_engine(model, prefix_cache=False, **engine_kwargs).generate([p], params)[0].token_ids
            for p in prompts]


def one_by_one(engine, prompts, params=GREEDY) -> list[list[int]]:
    return [engine.generate([p], params)[0].token_ids for p in prompts]


def cached_tokens(engine, prompt, params=GREEDY) -> tuple[list[int], int]:
    """A request's tokens and the prompt tokens it took from the cache."""
    request_id = engine.add_request(prompt, params)
    tokens, cached = [], None
    while cached is None:
        for output in engine.step():
            if output.request_id == request_id:
                tokens += output.new_token_ids
                cached = output.num_cached_tokens if output.finished else None
    return tokens, cached


@pytest.mark.parametrize("prefix_length", [40, 42])  # whole blocks; a partial last block
def test_a_shared_prefix_is_computed_once_and_changes_no_token(model, prefix_length):
    prompts = shared_prefix_prompts(prefix_length, 9, 13, 5)
    reference = alone_without_cache(model, prompts)
    engine = make_engine(model)
    first, cached = cached_tokens(engine, prompts[0])
    assert cached == 0 and first == reference[0]
    for prompt, expected in zip(prompts[1:], reference[1:]):
        tokens, cached = cached_tokens(engine, prompt)
        assert tokens == expected
        assert cached == prefix_length // BLOCK * BLOCK
    stats = engine.pool.prefix_cache.stats
    assert stats.lookups == 3 and stats.hits == 2


def test_a_repeated_prompt_computes_only_its_last_token(model):
    (prompt,) = prompts_of_lengths(41, seed=3)
    engine = make_engine(model)
    first, _ = cached_tokens(engine, prompt)
    again, cached = cached_tokens(engine, prompt)
    assert again == first == alone_without_cache(model, [prompt])[0]
    assert cached == 40
    (exact_blocks,) = prompts_of_lengths(40, seed=4)
    cached_tokens(engine, exact_blocks)
    _, cached = cached_tokens(engine, exact_blocks)
    assert cached == 36, "the last block is computed again: its last token's forward samples"


def test_generated_tokens_are_cached_for_the_next_turn(model):
    (prompt,) = prompts_of_lengths(30, seed=5)
    engine = make_engine(model)
    answer, _ = cached_tokens(engine, prompt)
    next_turn = prompt + answer + [17, 18, 19]
    tokens, cached = cached_tokens(engine, next_turn)
    assert cached == (len(prompt) + len(answer) - 1) // BLOCK * BLOCK, "only tokens with KV are cached"
    assert tokens == alone_without_cache(model, [next_turn])[0]


@pytest.mark.parametrize("policy", ["sarathi", "separate", "orca"])
def test_concurrent_requests_sharing_a_prefix_match_their_runs_alone(model, policy):
    prompts = shared_prefix_prompts(48, 3, 20, 7, 11, 30, 2)
    engine = make_engine(model, policy, token_budget=24)
    batched = engine.generate(prompts, GREEDY)
    assert [r.token_ids for r in batched] == alone_without_cache(model, prompts, policy=policy)
    again = engine.generate(prompts, GREEDY)  # now every one of them finds the prefix
    assert [r.token_ids for r in again] == [r.token_ids for r in batched]
    assert engine.pool.prefix_cache.stats.hits >= len(prompts)


def test_eviction_under_pressure_keeps_tokens_and_accounts_every_block(model):
    prompts = [p for seed in range(4) for p in shared_prefix_prompts(36, 6, 9, seed=seed)]
    # 3 layers x 30 blocks of 4 tokens: room for two requests, never for every prefix.
    engine = make_engine(model, num_blocks=90, max_running=2)
    assert one_by_one(engine, prompts) == alone_without_cache(model, prompts)
    pool = engine.pool
    assert pool.prefix_cache.stats.evicted > 0 and pool.prefix_cache.stats.hits > 0
    assert pool.num_free_blocks == pool.num_blocks and pool.num_used_blocks == 0


def test_preempting_a_sequence_that_holds_shared_blocks_changes_no_token(model):
    prompts = shared_prefix_prompts(32, 4, 6, 8, 10)
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    engine = make_engine(model, num_blocks=150, token_budget=64)
    warm, _ = cached_tokens(engine, prompts[0], params)
    results = engine.generate(prompts, params)
    assert engine.num_preemptions > 0, "the pool is small enough to preempt"
    assert [r.token_ids for r in results] == alone_without_cache(model, prompts, params)
    assert results[0].token_ids == warm
    assert engine.pool.num_free_blocks == engine.pool.num_blocks


def test_the_token_budget_counts_only_the_tokens_computed(model):
    prompts = shared_prefix_prompts(60, 10, 10)
    engine = make_engine(model, token_budget=64)
    engine.generate(prompts[:1], GREEDY)
    engine.add_request(prompts[1], GREEDY)
    engine.step()
    (chunk,) = engine.last_plan.prefills
    assert chunk.num_tokens == 70 - 60 and chunk.completes


def test_hits_never_cross_tenants_or_model_revisions(model):
    (prompt,) = prompts_of_lengths(40, seed=9)
    engine = make_engine(model)
    for salt in ("tenant-a", "tenant-b"):
        engine.add_request(prompt, GREEDY, cache_salt=salt)
        while engine.has_unfinished():
            finals = [o for o in engine.step() if o.finished]
            if finals:
                assert finals[0].num_cached_tokens == 0, f"{salt} found another tenant's blocks"
    _, cached = cached_tokens(engine, prompt)
    assert cached == 0, "no salt is a tenant of its own"
    shared_pool = engine.pool
    other_revision = make_engine(model, pool=shared_pool, model_revision="v2")
    _, cached = cached_tokens(other_revision, prompt)
    assert cached == 0


@pytest.mark.parametrize("keep_ratio", [0.5, 1.0])
def test_with_compression_a_hit_changes_no_token_and_stops_at_the_recent_window(model, keep_ratio):
    config = PyramidConfig(keep_ratio=keep_ratio)
    factory = engine_compressor_factory(config, model.config)
    prompts = shared_prefix_prompts(80, 12, 20)
    reference = alone_without_cache(model, prompts, compressor_factory=factory)
    engine = make_engine(model, compressor_factory=factory)
    assert one_by_one(engine, prompts[:1]) == reference[:1]
    tokens, cached = cached_tokens(engine, prompts[1])
    assert tokens == reference[1]
    window_start = factory(prompts[1], GREEDY).cacheable_tokens()
    assert 0 < cached <= window_start
    assert engine.pool.num_free_blocks == engine.pool.num_blocks


def last_logits_with_a_hit(model, prefix: list[int], prompt: list[int], chunk: int) -> torch.Tensor:
    """``prompt``'s last-token logits computed after ``prefix`` was cached by another request."""
    config = model.config
    pool = KVPool(config.num_hidden_layers, config.num_key_value_heads, config.head_dim,
                  block_size=BLOCK, num_blocks=256, dtype=model.dtype, cache_prefixes=True)
    memory, runner = KVManager(pool), ModelRunner(model, pool)

    def run(seq_id: str, tokens: list[int]) -> torch.Tensor:
        seq = Sequence(seq_id, tokens, GREEDY, arrival=0, sampler=None, decoder=None,
                       stop_matcher=None, status=Status.PREFILLING)
        assert memory.try_admit(seq)
        logits = None
        while seq.num_computed < len(tokens):
            step = PrefillChunk(seq, min(chunk, len(tokens) - seq.num_computed))
            _, logits = runner.execute(SchedulerOutput(prefills=[step]))
            seq.num_computed += step.num_tokens
            memory.cache_computed(seq)
        return logits.logits[0]

    if prefix:
        run("writer", prefix)
    return run("reader", prompt)


def test_bf16_with_a_hit_is_as_close_to_fp32_as_without():
    prompt = shared_prefix_prompts(64, 9)[0]
    fp32 = build_model()
    truth = last_logits_with_a_hit(fp32, [], prompt, chunk=len(prompt))
    bf16 = build_model().to(torch.bfloat16)
    without = (last_logits_with_a_hit(bf16, [], prompt, chunk=len(prompt)) - truth).abs().max()
    with_hit = (last_logits_with_a_hit(bf16, prompt[:64], prompt, chunk=len(prompt)) - truth).abs().max()
    scale = float(truth.abs().max())
    bar = max(2.0 * float(without), 4 * torch.finfo(torch.bfloat16).eps * scale)
    assert float(with_hit) <= bar
    # and in fp32 the hit is exact to fp32 rounding
    hit32 = last_logits_with_a_hit(fp32, prompt[:64], prompt, chunk=len(prompt))
    torch.testing.assert_close(hit32, truth, atol=1e-5, rtol=1e-5)
