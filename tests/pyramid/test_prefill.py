"""Prefill-phase selection: budgets, what is always kept, GQA, chunks, chain tails, decoding after."""

from __future__ import annotations

import math

import pytest
import torch
from baton.config import PyramidConfig
from baton.kv import DenseKV, KVPool
from baton.model import decode_step, prefill
from baton.pyramid import compressor_factory, prefill_compressed, pyramid_budgets, recent_window
from baton.pyramid.scoring import top_candidates
from pyramid_fixtures import PROMPT_LENGTH, build_model, hand_decode


class Recorder:
    """An observer that keeps every layer's queries and keys (to recompute scores by hand)."""

    def __init__(self) -> None:
        self.calls: dict[int, list] = {}

    def observe(self, layer, q, query_positions, k, key_positions):
        self.calls.setdefault(layer, []).append((q.clone(), query_positions.clone(), k.clone(),
                                                 key_positions.clone()))


def full_prefill(model, prompt, observer=None):
    kv = DenseKV(model.config.num_hidden_layers)
    logits = prefill(model, prompt, torch.arange(prompt.shape[0]), kv, observer=observer)
    return logits, kv.complete_layers()


def greedy(model, logits, layers, steps):
    """Greedy tokens and their logits, decoding from a (possibly compressed) cache."""
    kv = DenseKV(len(layers), layers)
    position = int(max(layer.positions.max() for layer in layers)) + 1
    tokens, all_logits = [], []
    for step in range(steps):
        token = int(logits.argmax())
        tokens.append(token)
        logits = decode_step(model, torch.tensor([token]), torch.tensor([position + step]), [kv])[0]
        all_logits.append(logits)
    return tokens, torch.stack(all_logits)


def reference_scores(config, model, calls, prompt_length):
    """score[s] = sum_r w_r * mean_h softmax(q_rh . k_s / sqrt(D)) over causally visible keys,
    written with explicit loops over queries and heads."""
    window = recent_window(config, prompt_length)
    start = prompt_length - window
    heads, kv_heads = model.config.num_attention_heads, model.config.num_key_value_heads
    scores = torch.zeros(prompt_length, dtype=torch.float64)
    for q, query_positions, k, key_positions in calls:
        for row in range(q.shape[0]):
            position = int(query_positions[row])
            if position < start:
                continue
            weight = 1.0 + 0.2 * (position - start) / (window - 1)
            visible = key_positions <= position
            for head in range(heads):
                kv_head = head // (heads // kv_heads)
                logits = (k[visible, kv_head].double() @ q[row, head].double()) / math.sqrt(q.shape[2])
                scores[key_positions[visible]] += weight * torch.softmax(logits, 0) / heads
    return scores


def test_full_budget_gives_identical_outputs(model, prompt):
    plain_logits, plain_layers = full_prefill(model, prompt)
    expected = greedy(model, plain_logits, plain_layers, 8)
    for config in (PyramidConfig(keep_ratio=1.0), PyramidConfig(enabled=False)):
        logits, layers = prefill_compressed(model, prompt, config)
        assert all(torch.equal(a.k, b.k) and torch.equal(a.positions, b.positions)
                   for a, b in zip(layers, plain_layers))
        tokens, decoded = greedy(model, logits, layers, 8)
        assert tokens == expected[0] and torch.equal(decoded, expected[1])


@pytest.mark.parametrize("keep_ratio", [0.3, 0.5, 0.8])
def test_layers_follow_the_schedule_and_keep_sinks_window_and_positions(model, prompt, keep_ratio):
    config = PyramidConfig(keep_ratio=keep_ratio)
    _, full = full_prefill(model, prompt)
    _, layers = prefill_compressed(model, prompt, config)
    budgets = pyramid_budgets(config, model.config.num_hidden_layers, PROMPT_LENGTH)
    assert [layer.num_tokens for layer in layers] == budgets
    assert budgets[0] > budgets[-1]
    window_start = PROMPT_LENGTH - recent_window(config, PROMPT_LENGTH)
    for layer, reference in zip(layers, full):
        kept = layer.positions.tolist()
        assert kept == sorted(set(kept))
        assert set(range(4)) | set(range(window_start, PROMPT_LENGTH)) <= set(kept)
        # Positions preserved: each kept row is the full cache's row at that position.
        assert torch.equal(layer.k, reference.k[layer.positions])
        assert torch.equal(layer.v, reference.v[layer.positions])


# (2, 1): heads of 32 dims, which baton's CPU scoring kernel takes (the others: torch's ops)
@pytest.mark.parametrize("heads, kv_heads", [(4, 2), (4, 1), (4, 4), (2, 1)])
def test_scores_average_all_query_heads_into_one_token_set(heads, kv_heads, prompt):
    model = build_model(heads, kv_heads, num_layers=2, seed=heads + kv_heads)
    config = PyramidConfig(keep_ratio=0.4)
    compressor = compressor_factory(config, model.config)(PROMPT_LENGTH)
    recorder = Recorder()

    class Both:
        def observe(self, *args):
            compressor.observe(*args)
            recorder.observe(*args)

    _, full = full_prefill(model, prompt, Both())
    layers = compressor.compress(full)
    for index, layer in enumerate(layers):
        expected = reference_scores(config, model, recorder.calls[index], PROMPT_LENGTH)
        torch.testing.assert_close(compressor.scores(index).double(), expected, rtol=1e-4,
                                   atol=1e-6)
        # The kept context tokens are the best by the hand-computed score.
        mandatory = set(range(4)) | set(range(PROMPT_LENGTH - 64, PROMPT_LENGTH))
        chosen = set(layer.positions.tolist()) - mandatory
        candidates = sorted(set(range(PROMPT_LENGTH)) - mandatory, key=lambda p: -expected[p])
        assert chosen == set(candidates[:len(chosen)])
        assert layer.k.shape[1] == kv_heads  # one position list serves every KV head


def test_chunked_prefill_scores_like_one_pass(model, prompt):
    config = PyramidConfig(keep_ratio=0.45)
    make = compressor_factory(config, model.config)
    whole = make(PROMPT_LENGTH)
    _, full = full_prefill(model, prompt, whole)
    chunked = make(PROMPT_LENGTH)
    kv = DenseKV(model.config.num_hidden_layers)
    for start in range(0, PROMPT_LENGTH, 70):  # the 64-token window spans the last two chunks
        end = min(start + 70, PROMPT_LENGTH)
        prefill(model, prompt[start:end], torch.arange(start, end), kv, observer=chunked,
                want_logits=False)
    for layer in range(model.config.num_hidden_layers):
        torch.testing.assert_close(chunked.scores(layer), whole.scores(layer), rtol=1e-5, atol=1e-6)
    assert [torch.equal(a, b) for a, b in zip(chunked.select(kv.complete_layers()),
                                              whole.select(full))] == [True] * len(full)


def test_chain_tail_scores_with_the_recent_queries_it_has(model, prompt):
    """A tail whose slice starts inside the recent window scores with its own queries only."""
    config = PyramidConfig(keep_ratio=0.45)
    tail_start = PROMPT_LENGTH - 40  # window is 64: 24 window queries ran on the previous rank
    recorder = Recorder()
    full_prefill(model, prompt, recorder)
    kv = DenseKV(model.config.num_hidden_layers)
    prefill(model, prompt[:tail_start], torch.arange(tail_start), kv, want_logits=False)
    tail = compressor_factory(config, model.config)(PROMPT_LENGTH)
    prefill(model, prompt[tail_start:], torch.arange(tail_start, PROMPT_LENGTH), kv, observer=tail)
    for layer in range(model.config.num_hidden_layers):
        q, query_positions, k, key_positions = recorder.calls[layer][0]
        tail_rows = query_positions >= tail_start
        expected = reference_scores(config, model, [(q[tail_rows], query_positions[tail_rows], k,
                                                     key_positions)], PROMPT_LENGTH)
        torch.testing.assert_close(tail.scores(layer).double(), expected, rtol=1e-4, atol=1e-6)
    kept = tail.compress(kv.complete_layers())
    assert all(set(range(PROMPT_LENGTH - 64, PROMPT_LENGTH)) <= set(layer.positions.tolist())
               for layer in kept)


def test_selection_is_deterministic(model, prompt):
    config = PyramidConfig(keep_ratio=0.3)
    first = [layer.positions for layer in prefill_compressed(model, prompt, config)[1]]
    second = [layer.positions for layer in prefill_compressed(model, prompt, config)[1]]
    assert all(torch.equal(a, b) for a, b in zip(first, second))


def test_ties_go_to_the_earlier_token():
    scores = torch.tensor([1.0, 2.0, 2.0, 2.0, 0.5])
    candidates = torch.tensor([True, True, True, True, False])
    assert top_candidates(scores, candidates, 2).tolist() == [1, 2]


def test_local_policy_keeps_only_the_most_recent(model, prompt):
    config = PyramidConfig(keep_ratio=0.4, policy="local")
    _, layers = prefill_compressed(model, prompt, config)
    budget = round(0.4 * PROMPT_LENGTH)
    expected = list(range(4)) + list(range(PROMPT_LENGTH - budget + 4, PROMPT_LENGTH))
    assert all(layer.positions.tolist() == expected for layer in layers)


def test_decoding_from_a_compressed_cache_attends_exactly_the_selected_keys(model, prompt):
    logits, layers = prefill_compressed(model, prompt, PyramidConfig(keep_ratio=0.3))
    _, full = full_prefill(model, prompt)
    token = int(logits.argmax())
    ours = decode_step(model, torch.tensor([token]), torch.tensor([PROMPT_LENGTH]),
                       [DenseKV(len(layers), layers)])[0]
    torch.testing.assert_close(ours, hand_decode(model, token, PROMPT_LENGTH, layers),
                               rtol=1e-5, atol=1e-5)
    # Not vacuous: the full cache gives different logits.
    assert not torch.allclose(ours, hand_decode(model, token, PROMPT_LENGTH, full), atol=1e-4)


def test_compressing_in_a_paged_pool_equals_compressing_dense_layers(model, prompt):
    config = PyramidConfig(keep_ratio=0.45)
    compressor = compressor_factory(config, model.config)(PROMPT_LENGTH)
    _, full = full_prefill(model, prompt, compressor)
    pool = KVPool(model.config.num_hidden_layers, model.config.num_key_value_heads,
                  model.config.head_dim, block_size=16, num_blocks=200)
    pool.store("seq", full)
    used_before = pool.num_used_blocks
    compressor.retain_in_pool(pool, "seq")
    for index, expected in enumerate(compressor.compress(full)):
        stored = pool.gather("seq", index)
        assert torch.equal(stored.positions, expected.positions)
        assert torch.equal(stored.k, expected.k) and torch.equal(stored.v, expected.v)
    assert pool.num_used_blocks == sum(pool.blocks_for(b) for b in compressor.budgets)
    assert pool.num_used_blocks < used_before
