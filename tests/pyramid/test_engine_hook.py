"""PyramidInfer inside the SARATHI engine: local prefills compressed, generations pruned."""

from __future__ import annotations

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
