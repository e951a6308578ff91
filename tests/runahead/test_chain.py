"""Real multi-process chains (gloo, one thread per rank) against a single-process prefill.

One chain per size p serves every case of that size: even, uneven, C not
divisible by p and C < p slices for KV-Runahead, then TSP; each case checks the
tail's K,V of every layer, the first-token logits and the byte counters against
the traffic formulas. Faults get chains of their own.
"""

from __future__ import annotations

import os
import signal
import time

import pytest
import torch
from baton.kv import DenseKV, KVPool, LayerKV
from baton.model import prefill, save_checkpoint
from baton.model.presets import random_model
from baton.runahead import ChainError, LocalChain, ModelSource
from hf_reference import tiny_config

pytestmark = pytest.mark.slow
TOLERANCE = 1e-4
CONFIG = tiny_config("llama3")  # GQA (4 query heads over 2 KV heads), Llama 3 RoPE scaling


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    model = random_model(CONFIG, seed=3)
    directory = tmp_path_factory.mktemp("tiny-llama3")
    save_checkpoint(model, directory, dtype=torch.float32)
    return directory, model


def reference(model, token_ids):
    kv = DenseKV(CONFIG.num_hidden_layers)
    logits = prefill(model, token_ids, torch.arange(token_ids.shape[0]), kv)
    return logits, kv.complete_layers()


def assert_matches(result, model, token_ids):
    logits, layers = reference(model, token_ids)
    assert (result.first_token_logits - logits).abs().max() < TOLERANCE
    assert len(result.layers) == CONFIG.num_hidden_layers
    for got, want in zip(result.layers, layers):
        assert torch.equal(got.positions, want.positions)
        assert (got.k - want.k).abs().max() < TOLERANCE
        assert (got.v - want.v).abs().max() < TOLERANCE


def layer_token_bytes() -> int:
    """Bytes of one token's K and V over all layers, fp32."""
    return CONFIG.num_hidden_layers * CONFIG.kv_bytes_per_token(4)


def cases(ranks: int) -> list[tuple[str, int, list[int] | None]]:
    uneven = [0] + [7 * (i + 1) for i in range(ranks - 1)] + [40]
    return [("even", 12 * ranks, None), ("uneven", 40, uneven),
            ("not divisible", 12 * ranks + 1, None), ("shorter than the chain", ranks - 1, None)]


class KeepRecent:
    """A real compression hook: checks it saw every layer, then keeps the last ``window`` tokens."""

    def __init__(self, prompt_length: int, window: int = 5) -> None:
        self.prompt_length = prompt_length
        self.window = window
        self.layers_seen: list[int] = []

    def observe(self, layer, q, query_positions, k, key_positions) -> None:
        assert k.shape[0] == self.prompt_length and int(query_positions[-1]) == self.prompt_length - 1
        self.layers_seen.append(layer)

    def compress(self, layers: list[LayerKV]) -> list[LayerKV]:
        assert self.layers_seen == list(range(len(layers))), "observer saw every layer once"
        return [LayerKV(x.k[-self.window:], x.v[-self.window:], x.positions[-self.window:])
                for x in layers]


@pytest.mark.parametrize("ranks", [2, 3, 4])
def test_chain_equals_single_process_prefill(checkpoint, ranks):
    directory, model = checkpoint
    generator = torch.Generator().manual_seed(ranks)
    with LocalChain(ModelSource(path=str(directory), dtype="float32"), ranks, timeout_s=20) as chain:
        for _name, length, boundaries in cases(ranks):
            token_ids = torch.randint(0, CONFIG.vocab_size, (length,), generator=generator)
            result = chain.prefill(token_ids, boundaries)
            assert_matches(result, model, token_ids)
            # KV-Runahead: rank i sends b_{i+1} tokens per layer -> b_1 + ... + b_{p-1}.
            sent_tokens = sum(result.boundaries[1:-1])
            assert result.bytes_sent == sent_tokens * layer_token_bytes()
            assert [c.bytes_received for c in result.counters[1:]] == \
                [c.bytes_sent for c in result.counters[:-1]]
            pairs = length * (length + 1) // 2 * CONFIG.num_attention_heads * CONFIG.num_hidden_layers
            assert sum(c.attention_dot_products for c in result.counters) == pairs

            tsp = chain.prefill(token_ids, mode="tsp")
            assert_matches(tsp, model, token_ids)
            padded = -(-length // ranks)  # all-gather moves equal (padded) slices
            assert tsp.bytes_sent == (ranks - 1) * ranks * padded * layer_token_bytes()
            if length % ranks == 0:
                assert tsp.bytes_sent == (ranks - 1) * length * layer_token_bytes()

        # Bad input is refused before it reaches a rank, and the chain keeps serving.
        with pytest.raises(ValueError, match=f"decreases at rank {ranks - 1}: 11 > 10"):
            chain.prefill(torch.arange(10), [0] + [6] * (ranks - 2) + [11, 10])
        with pytest.raises(ValueError, match="prompt of 1025 tokens exceeds the model's limit of 1024"):
            chain.prefill(torch.zeros(1025, dtype=torch.int64))
        token_ids = torch.randint(0, CONFIG.vocab_size, (9,), generator=generator)
        assert_matches(chain.prefill(token_ids), model, token_ids)


def test_tail_compresses_through_the_observer_seam_then_a_dead_rank_is_named(checkpoint):
    directory, model = checkpoint
    token_ids = torch.randint(0, CONFIG.vocab_size, (30,), generator=torch.Generator().manual_seed(0))
    with LocalChain(ModelSource(path=str(directory), dtype="float32"), 2, timeout_s=10,
                    make_observer=KeepRecent) as chain:
        result = chain.prefill(token_ids, [0, 17, 30])

        os.kill(chain.processes[1].pid, signal.SIGKILL)
        started = time.monotonic()
        with pytest.raises(ChainError, match="rank 1 exited with code -9"):
            chain.prefill(token_ids)
        assert time.monotonic() - started < 10
        with pytest.raises(ChainError, match="the chain is down: rank 1 exited"):
            chain.prefill(token_ids)

    logits, layers = reference(model, token_ids)
    assert (result.first_token_logits - logits).abs().max() < TOLERANCE
    pool = KVPool(CONFIG.num_hidden_layers, CONFIG.num_key_value_heads, CONFIG.head_dim,
                  block_size=4, num_blocks=64)
    pool.store("r", result.layers)  # the tail's cache is what the paged pool takes
    for index, want in enumerate(layers):
        got = pool.gather("r", index)
        assert got.positions.tolist() == list(range(25, 30))
        assert (got.k - want.k[25:]).abs().max() < TOLERANCE
        assert (got.v - want.v[25:]).abs().max() < TOLERANCE


def test_a_hung_rank_makes_its_neighbours_give_up_after_the_timeout(checkpoint):
    directory, _ = checkpoint
    chain = LocalChain(ModelSource(path=str(directory), dtype="float32"), 3, timeout_s=3)
    try:
        os.kill(chain.processes[1].pid, signal.SIGSTOP)  # alive but silent
        started = time.monotonic()
        with pytest.raises(ChainError, match="rank 1 stopped responding") as failure:
            chain.prefill(torch.arange(64) % CONFIG.vocab_size)
        assert "Timed out" in str(failure.value)  # the neighbours' own reports come along
        assert time.monotonic() - started < 3 + 10
    finally:
        chain.close()  # kills the stopped rank


@pytest.mark.parametrize("variant", ["qwen3", "qwen3_moe"])
def test_a_qwen3_chain_equals_single_process_prefill(tmp_path, variant):
    """Per-head q/k norms, an explicit head_dim and routed experts go down a chain unchanged."""
    config = tiny_config(variant)
    model = random_model(config, seed=5)
    save_checkpoint(model, tmp_path, dtype=torch.float32)
    token_ids = torch.randint(0, config.vocab_size, (45,), generator=torch.Generator().manual_seed(5))
    kv = DenseKV(config.num_hidden_layers)
    logits = prefill(model, token_ids, torch.arange(45), kv)
    with LocalChain(ModelSource(path=str(tmp_path), dtype="float32"), 2, timeout_s=20) as chain:
        result = chain.prefill(token_ids, [0, 26, 45])
    assert (result.first_token_logits - logits).abs().max() < TOLERANCE
    for got, want in zip(result.layers, kv.complete_layers(), strict=True):
        assert (got.k - want.k).abs().max() < TOLERANCE and (got.v - want.v).abs().max() < TOLERANCE
