"""Generation-phase update: batches that leave the recent window are pruned per layer, bounded."""

from __future__ import annotations

import pytest
import torch
from baton.config import PyramidConfig
from baton.kernels import cpu as cpu_kernels
from baton.kv import KVPool
from baton.model import Segment
from baton.model.forward_batch import DecodeBatch
from baton.pyramid import GenerationCompressor, generation_keep_counts, prefill_compressed
from pyramid_fixtures import PROMPT_LENGTH, build_model, hand_decode

STEPS = 120
WINDOW = 64  # 20% of the 320-token prompt


def decode_with_updates(model, prompt, config, steps):
    """Greedy decoding from a compressed prompt in a pool, with the update after every step."""
    logits, layers = prefill_compressed(model, prompt, config)
    pool = KVPool(model.config.num_hidden_layers, model.config.num_key_value_heads,
                  model.config.head_dim, block_size=16, num_blocks=400)
    pool.store("seq", layers)
    compressor = GenerationCompressor(config, model.config)
    observer = compressor.track("seq", PROMPT_LENGTH)
    history = []
    for step in range(steps):
        token = torch.tensor([int(logits.argmax())])
        position = torch.tensor([PROMPT_LENGTH + step])
        hidden = model(token, position, [Segment(1, pool.view("seq"), observer)],
                       torch.tensor([0]))
        logits = model.logits(hidden)[0]
        compressor.after_step(pool, "seq")
        history.append(pool.lengths("seq"))
    return pool, [layer.num_tokens for layer in layers], history, int(logits.argmax())


def test_update_bounds_every_layer_by_its_keep_count(model, prompt):
    config = PyramidConfig(keep_ratio=0.5)
    pool, prefill_lengths, history, _ = decode_with_updates(model, prompt, config, STEPS)
    keep = generation_keep_counts(config, model.config.num_hidden_layers)
    first_unscored = PROMPT_LENGTH - WINDOW
    for step, lengths in enumerate(history, start=1):
        batches = (step // 16)  # window start moved `step` tokens past the first unscored one
        expected = [p + step - batches * (16 - k) for p, k in zip(prefill_lengths, keep)]
        assert lengths == expected, (step, lengths, expected)
    for layer, count in enumerate(keep):
        positions = pool.gather("seq", layer).positions.tolist()
        assert positions == sorted(positions)
        assert set(range(4)) <= set(positions)
        newest = PROMPT_LENGTH + STEPS - 1
        assert set(range(newest - WINDOW + 1, newest + 1)) <= set(positions)  # the sliding window
        for batch in range(STEPS // 16):
            start = first_unscored + 16 * batch
            assert sum(start <= p < start + 16 for p in positions) == count
    assert keep[0] > keep[-1]


def test_decoding_continues_exactly_over_the_pruned_cache(model, prompt):
    config = PyramidConfig(keep_ratio=0.5)
    pool, _, _, token = decode_with_updates(model, prompt, config, 40)
    layers = [pool.gather("seq", layer) for layer in range(model.config.num_hidden_layers)]
    position = PROMPT_LENGTH + 40
    hidden = model(torch.tensor([token]), torch.tensor([position]),
                   [Segment(1, pool.view("seq"))], torch.tensor([0]))
    torch.testing.assert_close(model.logits(hidden)[0], hand_decode(model, token, position, layers),
                               rtol=1e-5, atol=1e-5)


def test_untracked_or_forgotten_sequences_are_left_alone(model, prompt):
    config = PyramidConfig(keep_ratio=0.5)
    compressor = GenerationCompressor(config, model.config)
    pool = KVPool(model.config.num_hidden_layers, model.config.num_key_value_heads,
                  model.config.head_dim, block_size=16, num_blocks=10)
    assert compressor.after_step(pool, "unknown") == 0
    compressor.track("seq", PROMPT_LENGTH)
    assert compressor.observer("seq") is not None
    compressor.forget("seq")
    assert compressor.observer("seq") is None


def test_an_observed_decode_batch_reads_the_pruned_cache_where_it_lies(prompt):
    """Observers of generated tokens record queries only, so an observed decode batch keeps
    the in-place kernel: same logits as attention over the gathered cache, and the row's
    queries of every layer seen in one call."""
    if not cpu_kernels.has("paged_decode_attention"):
        pytest.skip("no kernel module on this machine (no AVX2 CPU or no compiler)")
    model = build_model(num_heads=2, num_kv_heads=1)  # heads of 32: the kernel's shapes
    assert model.reads_decode_cache_in_place(model.dtype)
    config = PyramidConfig(keep_ratio=0.5)
    pool, _, _, token = decode_with_updates(model, prompt, config, 40)
    layers = [pool.gather("seq", layer) for layer in range(model.config.num_hidden_layers)]
    position = PROMPT_LENGTH + 40
    seen = []

    class Recording:
        def observe_decode(self, queries, query_position) -> None:
            seen.append((tuple(queries.shape), query_position))

    step = pool.begin_decode(["seq"], grouped=False)
    hidden = model(torch.tensor([token]), torch.tensor([position]), [], torch.tensor([0]),
                   DecodeBatch(step, [Recording()]))
    torch.testing.assert_close(model.logits(hidden)[0], hand_decode(model, token, position, layers),
                               rtol=1e-5, atol=1e-5)
    config = model.config
    assert seen == [((config.num_hidden_layers, config.num_attention_heads, config.head_dim), position)]
