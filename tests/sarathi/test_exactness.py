"""Exactness in fp32: chunked == whole prefill, batched == alone, preempted == never preempted,
ours == transformers, and KV from a chain == a local prefill."""

from __future__ import annotations

import pytest
import torch
from baton.config import SCHEDULER_POLICIES
from baton.kv import DenseKV, KVPool, LayerKV
from baton.model import load_checkpoint, prefill
from baton.sampling.params import SamplingParams
from baton.sarathi.request import Sequence
from baton.sarathi.runner import ModelRunner, StepLogits
from baton.sarathi.scheduler import PrefillChunk, SchedulerOutput
from engine_fixtures import make_engine, prompts_of_lengths
from hf_reference import save_random_hf_model, tiny_config

GREEDY = SamplingParams(temperature=0.0, max_tokens=12)
POLICIES = list(SCHEDULER_POLICIES)  # a new policy is held to exactness as it registers


def chunked_logits(model, prompt: list[int], chunk_size: int) -> torch.Tensor:
    """The prompt's last-token logits when the runner feeds it chunk by chunk from a pool."""
    config = model.config
    pool = KVPool(config.num_hidden_layers, config.num_key_value_heads, config.head_dim,
                  block_size=16, num_blocks=64)
    runner = ModelRunner(model, pool)
    seq = Sequence("s", prompt, GREEDY, arrival=0, sampler=None, decoder=None, stop_matcher=None)
    logits = None
    while seq.num_computed < len(prompt):
        chunk = PrefillChunk(seq, min(chunk_size, len(prompt) - seq.num_computed))
        sampling, logits = runner.execute(SchedulerOutput(prefills=[chunk]))
        assert (sampling == [seq]) == chunk.completes, "only the final chunk yields logits"
        seq.num_computed += chunk.num_tokens
    return logits.logits[0]


@pytest.mark.parametrize("chunk_size", [1, 7, 64, 90])
def test_chunked_prefill_gives_the_whole_prompts_logits(model, chunk_size):
    (prompt,) = prompts_of_lengths(90)
    whole = prefill(model, torch.tensor(prompt), torch.arange(90),
                    DenseKV(model.config.num_hidden_layers))
    torch.testing.assert_close(chunked_logits(model, prompt, chunk_size), whole, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("policy", POLICIES)
def test_greedy_output_alone_equals_batched_with_others(model, policy):
    prompts = prompts_of_lengths(5, 37, 90, 150)
    alone = [make_engine(model, policy).generate([p], GREEDY)[0].token_ids for p in prompts]
    batched = make_engine(model, policy).generate(prompts, GREEDY)
    assert [r.token_ids for r in batched] == alone
    assert all(len(tokens) == GREEDY.max_tokens for tokens in alone)


@pytest.mark.parametrize("token_budget", [8, 33, 512])
def test_budget_changes_the_schedule_not_the_tokens(model, token_budget):
    prompts = prompts_of_lengths(40, 90)
    reference = make_engine(model, token_budget=512).generate(prompts, GREEDY)
    engine = make_engine(model, token_budget=token_budget)
    assert [r.token_ids for r in engine.generate(prompts, GREEDY)] == [r.token_ids for r in reference]


def test_seeded_sampling_is_the_same_alone_and_batched_with_greedy_rows(model):
    params = SamplingParams(temperature=0.9, top_k=50, top_p=0.9, seed=1234, max_tokens=10)
    prompts = prompts_of_lengths(12, 60, 33)
    alone = make_engine(model).generate([prompts[0]], params)[0].token_ids
    greedy_alone = make_engine(model).generate([prompts[2]], GREEDY)[0].token_ids
    batched = make_engine(model).generate(prompts, [params, SamplingParams(temperature=1.0, seed=7),
                                                    GREEDY])
    assert batched[0].token_ids == alone and batched[2].token_ids == greedy_alone


def test_a_steps_logits_give_each_row_its_first_maximum_and_the_drawn_rows_whole():
    logits = torch.randn(6, 50, generator=torch.Generator().manual_seed(0))
    logits[4, 30] = logits[4, 11] = logits[4].max() + 1
    greedy, drawn = StepLogits(logits).pick([1, 4])
    assert greedy == [int(torch.argmax(row)) for row in logits] and greedy[4] == 11
    assert sorted(drawn) == [1, 4] and all(torch.equal(drawn[row], logits[row]) for row in drawn)
    assert StepLogits(logits).pick([])[1] == {}


PREEMPTION_PROMPTS = prompts_of_lengths(20, 20, 20, 20)
PREEMPTION_PARAMS = SamplingParams(temperature=0.0, max_tokens=16)


@pytest.fixture(scope="module")
def without_preemption(model) -> list[list[int]]:
    return [r.token_ids for r in make_engine(model).generate(PREEMPTION_PROMPTS, PREEMPTION_PARAMS)]


@pytest.mark.parametrize("policy", POLICIES)
def test_preempted_and_recomputed_output_is_identical(model, policy, without_preemption):
    # 3 layers x 4-token blocks: 45 blocks hold 60 tokens per layer, far less than 4 x 36.
    tight = make_engine(model, policy, num_blocks=45)
    results = tight.generate(PREEMPTION_PROMPTS, PREEMPTION_PARAMS)
    assert tight.num_preemptions > 0
    assert [r.token_ids for r in results] == without_preemption
    assert tight.pool.num_free_blocks == 45


def test_completion_and_abort_return_every_block(model):
    engine = make_engine(model, num_blocks=200)
    engine.generate(prompts_of_lengths(20, 45), GREEDY)
    assert engine.pool.num_free_blocks == 200
    keep, drop = prompts_of_lengths(50, 70)
    kept_id = engine.add_request(keep, SamplingParams(temperature=0.0, max_tokens=30))
    dropped_id = engine.add_request(drop, SamplingParams(temperature=0.0, max_tokens=30))
    for _ in range(4):
        engine.step()
    assert engine.pool.num_free_blocks < 200
    engine.abort(dropped_id)
    outputs = {o.request_id: o for o in engine.step()}
    assert outputs[dropped_id].finish_reason == "abort"
    assert not engine.pool.has(dropped_id)
    while engine.has_unfinished():
        engine.step()
    assert not engine.pool.has(kept_id)
    assert engine.pool.num_free_blocks == 200


def test_greedy_equals_transformers_generate(tmp_path):
    config = tiny_config("llama3", num_attention_heads=4, num_key_value_heads=2, head_dim=32)
    hf_model = save_random_hf_model(config, tmp_path)
    ours = load_checkpoint(tmp_path, dtype="float32", device="cpu", with_tokenizer=False)
    prompts = prompts_of_lengths(7, 23, 61)
    results = make_engine(ours.model, token_budget=16).generate(
        prompts, SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True))
    for prompt, result in zip(prompts, results):
        expected = hf_model.generate(torch.tensor([prompt]), max_new_tokens=16, do_sample=False,
                                     min_new_tokens=16, pad_token_id=0)[0, len(prompt):].tolist()
        assert result.token_ids == expected


class KeepEveryOtherDeepToken:
    """A stand-in compressor: deeper layers keep every other prompt token (and the last)."""

    def __init__(self) -> None:
        self.observed_layers: set[int] = set()
        self.decoded_positions: list[int] = []
        self.decode_calls = 0

    def observe(self, layer, q, query_positions, k, key_positions) -> None:
        self.observed_layers.add(layer)

    def observe_decode(self, queries, position) -> None:
        self.decoded_positions.append(position)

    def cacheable_tokens(self) -> int:
        return 0  # it does not say what it needs: no prefix-cache hits

    def compress(self, layers: list[LayerKV]) -> list[LayerKV]:
        return [layer if index == 0 else _every_other(layer) for index, layer in enumerate(layers)]

    def after_decode(self, pool, seq_id) -> None:
        self.decode_calls += 1


def _every_other(layer: LayerKV) -> LayerKV:
    keep = torch.arange(layer.num_tokens) % 2 == 0
    keep[-1] = True
    return LayerKV(layer.k[keep], layer.v[keep], layer.positions[keep])


def test_pyramid_shaped_kv_from_a_chain_continues_like_a_local_compressed_prefill(model):
    (prompt,) = prompts_of_lengths(41)
    params = SamplingParams(temperature=0.0, max_tokens=10)
    compressors = []

    def factory(token_ids, sampling_params):
        compressors.append(KeepEveryOtherDeepToken())
        return compressors[-1]

    local = make_engine(model, token_budget=16, compressor_factory=factory).generate([prompt], params)[0]
    assert compressors[0].observed_layers == {0, 1, 2}
    # Decodes 2..10 each follow a step; the last one finishes the request instead.
    assert compressors[0].decode_calls == params.max_tokens - 2
    # and every decode step's forward showed it its token, at the token's position
    assert compressors[0].decoded_positions == list(range(41, 41 + params.max_tokens - 1))

    # The "chain": a dense prefill, compressed the same way, handed over with its logits.
    dense = DenseKV(model.config.num_hidden_layers)
    logits = prefill(model, torch.tensor(prompt), torch.arange(len(prompt)), dense)
    shipped = KeepEveryOtherDeepToken().compress(dense.complete_layers())
    assert len({layer.num_tokens for layer in shipped}) == 2, "pyramid-shaped"
    engine = make_engine(model)
    request_id = engine.add_prefilled_request(prompt, shipped, logits, params)
    first = engine.step()
    assert engine.pool.lengths(request_id) == [42, 22, 22]  # the shipped cache plus one decode
    tokens = first[0].new_token_ids
    while engine.has_unfinished():
        tokens += [t for o in engine.step() for t in o.new_token_ids]
    assert tokens == local.token_ids
    assert engine.pool.num_free_blocks == engine.pool.num_blocks
