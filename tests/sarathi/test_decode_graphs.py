"""Decode steps replayed from static, padded buffers (``DecodeGraphs``) compute what the eager
step computes. On a CPU nothing is captured (``capture=False``): the same static step, its
padding, its scratch block and its query recording run eagerly; the GPU tests replay graphs."""

from __future__ import annotations

import pytest
import torch
from baton.config import PyramidConfig
from baton.kv import KVPool
from baton.pyramid import engine_compressor_factory
from baton.sampling.params import SamplingParams
from baton.sarathi.decode_graphs import DecodeGraphs, batch_bucket, width_bucket, width_buckets
from baton.sarathi.request import Sequence
from baton.sarathi.runner import ModelRunner
from baton.sarathi.scheduler import PrefillChunk, SchedulerOutput
from engine_fixtures import make_engine, prompts_of_lengths

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
BLOCK_SIZE = 4


def test_buckets():
    assert [batch_bucket(n) for n in (1, 2, 3, 5, 8, 9, 64, 65)] == [1, 2, 4, 8, 8, 16, 64, 128]
    assert [width_bucket(n) for n in range(1, 14)] == [1, 2, 3, 4, 6, 6, 8, 8, 12, 12, 12, 12, 16]
    # never more than 1.5x the blocks a step needs, and always at least them
    assert all(n <= width_bucket(n) <= max(2, 1.5 * n) for n in range(1, 2000))
    assert width_buckets(48) == [1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48]


def test_the_buckets_captured_up_front_cover_every_step_the_pool_and_the_batch_allow(model):
    config = model.config
    pool = KVPool(config.num_hidden_layers, config.num_key_value_heads, config.head_dim,
                  block_size=BLOCK_SIZE, num_blocks=120)
    graphs = DecodeGraphs(model, pool, max_batch=6, max_context=64, capture=False)
    buckets = graphs.buckets()
    assert {batch for batch, _ in buckets} == {1, 2, 4, 8}  # 5 or 6 sequences replay in 8
    assert {width for _, width in buckets} == set(width_buckets(16))  # 64 tokens: 16 blocks
    held = 120 // config.num_hidden_layers  # what one layer's blocks can hold between the rows
    for batch in (1, 2, 4, 8):
        for width in width_buckets(16):
            assert ((batch, width) in buckets) == (batch * width <= 4 * held)
    assert graphs.capture_all() == 0  # nothing is captured without CUDA


def prefilled(model, lengths: tuple[int, ...], num_blocks: int = 256):
    """A pool holding one prompt per length, and their sequences (each prompt's next token
    is its last one, fed again: any token will do)."""
    config = model.config
    pool = KVPool(config.num_hidden_layers, config.num_key_value_heads, config.head_dim,
                  block_size=BLOCK_SIZE, num_blocks=num_blocks)
    runner = ModelRunner(model, pool)
    seqs = []
    for index, prompt in enumerate(prompts_of_lengths(*lengths)):
        seq = Sequence(f"s{index}", prompt + [prompt[-1]], GREEDY, arrival=index, sampler=None,
                       decoder=None, stop_matcher=None)
        runner.execute(SchedulerOutput(prefills=[PrefillChunk(seq, len(prompt))]))
        seq.num_computed = len(prompt)
        seqs.append(seq)
    return pool, seqs


@pytest.fixture(params=["cache in place", "gathered"])
def reader(request, model, monkeypatch):
    """The two ways decode attention reads the pool: baton's CPU kernel over the block tables
    (what a CPU runs), and gathered into padded tensors under a bias (what a GPU runs)."""
    if request.param == "gathered":
        monkeypatch.setattr(type(model), "reads_decode_cache_in_place", lambda self, *args: False)
    return request.param


@pytest.mark.parametrize("lengths", [(9,), (3, 17, 40), (5, 6, 7, 30, 31)])
def test_a_replayed_step_equals_the_eager_step(model, reader, lengths):
    eager_pool, eager_seqs = prefilled(model, lengths)
    static_pool, static_seqs = prefilled(model, lengths)
    graphs = DecodeGraphs(model, static_pool, capture=False)
    eager = ModelRunner(model, eager_pool).execute(SchedulerOutput(decodes=eager_seqs))
    static = ModelRunner(model, static_pool, graphs).execute(SchedulerOutput(decodes=static_seqs))
    assert graphs.replayed_steps == 1
    assert [seq.request_id for seq in static[0]] == [seq.request_id for seq in eager[0]]
    torch.testing.assert_close(static[1].logits, eager[1].logits, atol=1e-5, rtol=1e-5)
    # the same K/V written to the same slots; the padded rows wrote only the scratch block
    scratch = static_pool.scratch_block()
    used = torch.ones(static_pool.num_blocks, dtype=torch.bool)
    used[scratch] = False
    torch.testing.assert_close(static_pool.k_cache[used], eager_pool.k_cache[used], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(static_pool.v_cache[used], eager_pool.v_cache[used], atol=1e-5, rtol=1e-5)
    assert all(static_pool.lengths(s.request_id) == eager_pool.lengths(s.request_id) for s in static_seqs)


def test_steps_past_the_largest_buckets_run_eagerly(model):
    pool, seqs = prefilled(model, (3, 17, 40))
    graphs = DecodeGraphs(model, pool, max_batch=2, max_context=16, capture=False)
    assert not graphs.fits(3) and graphs.fits(2)
    claimed = pool.claim_decode([seqs[0].request_id, seqs[2].request_id])  # 41 tokens > 16
    assert graphs.run(claimed, [1, 2], [3, 40], [None, None]) is None
    claimed = pool.claim_decode([seqs[0].request_id])  # 5 tokens
    assert graphs.run(claimed, [1], [4], [None]).shape == (1, model.config.vocab_size)
    assert graphs.replayed_steps == 1


def test_a_full_pool_leaves_no_scratch_block_and_the_step_runs_eagerly(model):
    # 3 layers x 3 blocks of 4 tokens hold a 9-token prompt and its next token: nothing is left
    pool, (seq,) = prefilled(model, (9,), num_blocks=9)
    eager_pool, (eager_seq,) = prefilled(model, (9,), num_blocks=9)
    graphs = DecodeGraphs(model, pool, capture=False)
    _, logits = ModelRunner(model, pool, graphs).execute(SchedulerOutput(decodes=[seq]))
    _, expected = ModelRunner(model, eager_pool).execute(SchedulerOutput(decodes=[eager_seq]))
    assert pool.num_free_blocks == 0 and graphs.num_graphs == 0
    torch.testing.assert_close(logits.logits, expected.logits, atol=0, rtol=0)


def with_static_decode(engine):
    engine.runner.graphs = DecodeGraphs(engine.model, engine.pool, capture=False)
    return engine


@pytest.mark.parametrize("policy", ["sarathi", "separate"])
def test_greedy_generation_with_static_decode_steps_is_unchanged(model, reader, policy):
    prompts = prompts_of_lengths(5, 37, 90, 150)
    expected = [r.token_ids for r in make_engine(model, policy).generate(prompts, GREEDY)]
    engine = with_static_decode(make_engine(model, policy))
    assert [r.token_ids for r in engine.generate(prompts, GREEDY)] == expected
    assert engine.runner.graphs.replayed_steps >= GREEDY.max_tokens // 2


def test_pyramid_generation_phase_sees_the_same_queries(model, reader):
    # PyramidInfer's generation phase re-scores the cache from the decode steps' queries: with
    # static steps they come from the recorded buffer, after the step; the kept tokens, and so
    # the generated ones, must not change.
    factory = engine_compressor_factory(PyramidConfig(keep_ratio=0.5, generation_update_every=4),
                                        model.config)
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    prompts = prompts_of_lengths(120, 150)
    expected = make_engine(model, "separate", compressor_factory=factory).generate(prompts, params)
    engine = with_static_decode(make_engine(model, "separate", compressor_factory=factory))
    results = engine.generate(prompts, params)
    assert [r.token_ids for r in results] == [r.token_ids for r in expected]
    assert engine.runner.graphs.replayed_steps >= params.max_tokens - 1


def test_a_capture_that_fails_turns_graphs_off_and_the_step_runs_eagerly(model, caplog):
    # Capturing on a machine without CUDA fails for real: the fallback a GPU takes when some
    # operation of the step cannot be captured.
    pool, seqs = prefilled(model, (3, 17))
    eager_pool, eager_seqs = prefilled(model, (3, 17))
    graphs = DecodeGraphs(model, pool, capture=True)
    _, logits = ModelRunner(model, pool, graphs).execute(SchedulerOutput(decodes=seqs))
    _, expected = ModelRunner(model, eager_pool).execute(SchedulerOutput(decodes=eager_seqs))
    torch.testing.assert_close(logits.logits, expected.logits, atol=0, rtol=0)
    assert not graphs.enabled and not graphs.fits(1) and graphs.replayed_steps == 0
    assert "batch 2, width 6" in graphs.failure
    assert "CUDA graphs are off for this process" in caplog.text


def test_a_ragged_batch_runs_eagerly_a_uniform_one_replays(model):
    # one 200-token sequence among seven of 3: padded to the long one's width, the graph
    # would read 8 x 64 blocks for the 51 + 7 x 1 the rows hold
    pool, seqs = prefilled(model, (200, 3, 3, 3, 3, 3, 3, 3), num_blocks=1024)
    graphs = DecodeGraphs(model, pool, capture=False)
    ModelRunner(model, pool, graphs).execute(SchedulerOutput(decodes=seqs))
    assert graphs.replayed_steps == 0
    ModelRunner(model, pool, graphs).execute(SchedulerOutput(decodes=seqs[1:]))
    assert graphs.replayed_steps == 1


def test_capturing_every_bucket_up_front_is_for_a_gpu(model):
    pool, _ = prefilled(model, (9,))
    assert DecodeGraphs(model, pool, capture=False).capture_all() == 0  # nothing to capture
    free = pool.num_free_blocks
    graphs = DecodeGraphs(model, pool, capture=True)  # on this CPU the first capture fails
    assert graphs.capture_all() == 0 and not graphs.enabled and "batch 1, width 1" in graphs.failure
    assert pool.num_free_blocks == free - 1  # the scratch block, set aside
