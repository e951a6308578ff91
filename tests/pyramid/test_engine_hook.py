"""PyramidInfer inside the SARATHI engine: local prefills compressed, generations pruned."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from baton.config import KVPoolConfig, PyramidConfig, SchedulerConfig
from baton.pyramid import engine_compressor_factory, layer_budgets
from baton.sampling.params import CompressionParams, SamplingParams
from baton.sarathi import Engine


def make_engine(model, config: PyramidConfig | None) -> Engine:
    factory = None if config is None else engine_compressor_factory(config, model.config)
    return Engine(model, None, scheduler=SchedulerConfig(token_budget=128),
                  kv=KVPoolConfig(block_size=8, num_blocks=2048), compressor_factory=factory)


def greedy(max_tokens: int, **compression) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True,
                          compression=CompressionParams(**compression))


def lengths_after_prefill(engine: Engine, prompt: list[int], params: SamplingParams) -> list[int]:
    request_id = engine.add_request(prompt, params)
    while not any(output.request_id == request_id and output.new_token_ids
                  for output in engine.step()):
        pass
    return engine.pool.lengths(request_id)


def test_full_budget_generates_exactly_as_without_compression(model, prompt):
    prompt = prompt.tolist()
    plain = make_engine(model, None).generate([prompt], greedy(24))[0]
    keep_everything = PyramidConfig(keep_ratio=1.0, generation_keep_first=1.0,
                                    generation_keep_last=1.0)
    kept_all = make_engine(model, keep_everything).generate([prompt], greedy(24))[0]
    assert kept_all.token_ids == plain.token_ids


def test_local_prefill_is_cut_to_the_pyramid_and_a_request_can_opt_out(model, prompt):
    config = PyramidConfig(keep_ratio=0.5)
    prompt_length = len(prompt)
    budgets = layer_budgets(config, model.config.num_hidden_layers, prompt_length)
    assert sum(budgets) < model.config.num_hidden_layers * prompt_length
    engine = make_engine(model, config)
    assert lengths_after_prefill(engine, prompt.tolist(), greedy(8)) == budgets
    opted_out = lengths_after_prefill(engine, prompt.tolist(), greedy(8, enabled=False))
    assert opted_out == [prompt_length] * model.config.num_hidden_layers
    deployment_off = make_engine(model, PyramidConfig(enabled=False))
    opted_in = lengths_after_prefill(deployment_off, prompt.tolist(), greedy(8, enabled=True, keep_ratio=0.5))
    assert opted_in == budgets


def test_generation_phase_prunes_tokens_that_leave_the_window(model, prompt):
    config = PyramidConfig(keep_ratio=1.0)  # no prompt pruning: only the generation phase acts
    engine = make_engine(model, config)
    request_id = engine.add_request(prompt.tolist(), greedy(200))
    generated = 0
    lengths = None
    while engine.has_unfinished() and generated < 150:
        for output in engine.step():
            generated += len(output.new_token_ids)
        if engine.pool.has(request_id):
            lengths = engine.pool.lengths(request_id)
    stored = len(prompt) + generated - 1  # the newest token is not in the cache yet
    assert lengths is not None and lengths[0] <= stored
    assert lengths[-1] < stored - 16, "the last layer must have dropped scored batches"
    assert lengths == sorted(lengths, reverse=True), "deeper layers keep fewer tokens"
    engine.abort(request_id)
    engine.step()
    assert engine.pool.num_free_blocks == engine.pool.num_blocks
    assert torch.isfinite(torch.tensor(lengths, dtype=torch.float32)).all()


def continue_stream(engine: Engine, token_ids: list[int], params: SamplingParams,
                    generated_before: int) -> list[int]:
    request_id = engine.add_request(token_ids, params, generated_before=generated_before)
    tokens = []
    while engine.has_unfinished():
        tokens += [t for output in engine.step() if output.request_id == request_id
                   for t in output.new_token_ids]
    return tokens


MOVED_CONFIG = PyramidConfig(keep_ratio=0.5)
MOVED_TOKENS = 100  # the generation phase prunes every 16 tokens from the 16th on
MOVED_PARAMS = {"greedy": SamplingParams(temperature=0.0, max_tokens=MOVED_TOKENS, ignore_eos=True),
                "seeded": SamplingParams(temperature=0.9, seed=5, max_tokens=MOVED_TOKENS, ignore_eos=True)}


@pytest.fixture(scope="module")
def unmoved(model, prompt) -> dict[str, list[int]]:
    return {kind: make_engine(model, MOVED_CONFIG).generate([prompt.tolist()], params)[0].token_ids
            for kind, params in MOVED_PARAMS.items()}


@pytest.mark.parametrize("sent", [8, 70])  # before the first pruning, and after several
@pytest.mark.parametrize("kind", sorted(MOVED_PARAMS))
def test_a_compressed_stream_moved_to_another_engine_continues_token_for_token(model, prompt, unmoved,
                                                                               kind, sent):
    # What a decode pod does for a stream that moved to it with PyramidInfer on: the prompt
    # plus the tokens sent so far, told how many were generated. The new engine prefills the
    # prompt alone (the same pyramid) and replays the sent tokens through decode steps (the
    # same generation-phase pruning), so the rest is what the first engine would have made.
    whole = unmoved[kind]
    params = dataclasses.replace(MOVED_PARAMS[kind], max_tokens=MOVED_TOKENS - sent)
    rest = continue_stream(make_engine(model, MOVED_CONFIG), prompt.tolist() + whole[:sent], params, sent)
    assert whole[:sent] + rest == whole


def test_a_preempted_compressed_sequence_is_recomputed_into_the_same_cache(model, prompt):
    # Four compressed generations in a pool too small for them all: some are preempted and
    # recomputed (the prompt prefilled, the tokens replayed), and every stream gives the
    # tokens it gives with room to spare.
    config = PyramidConfig(keep_ratio=0.5)
    prompts = [prompt.tolist()[index * 80:(index + 1) * 80] for index in range(4)]
    params = greedy(100)
    roomy = make_engine(model, config).generate(prompts, params)
    tight = Engine(model, None, scheduler=SchedulerConfig(token_budget=128),
                   kv=KVPoolConfig(block_size=8, num_blocks=170),
                   compressor_factory=engine_compressor_factory(config, model.config))
    results = tight.generate(prompts, params)
    assert tight.num_preemptions > 0
    assert [r.token_ids for r in results] == [r.token_ids for r in roomy]
