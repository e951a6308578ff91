"""The paged KV pool: per-layer block tables, exact accounting, typed exhaustion."""

from __future__ import annotations

import pytest
import torch
from baton.kv import DenseKV, KVPool, KVPoolExhausted, LayerKV

LAYERS, HEADS, DIM, BLOCK = 3, 2, 4, 4


def make_pool(num_blocks: int = 16) -> KVPool:
    return KVPool(LAYERS, HEADS, DIM, block_size=BLOCK, num_blocks=num_blocks)


def random_kv(tokens: int, start: int = 0):
    return torch.randn(tokens, HEADS, DIM), torch.randn(tokens, HEADS, DIM), torch.arange(start, start + tokens)


def test_append_and_gather_across_blocks_round_trip():
    pool = make_pool()
    k1, v1, p1 = random_kv(6)
    k2, v2, p2 = random_kv(5, start=6)
    pool.append("a", 0, k1, v1, p1)
    pool.append("a", 0, k2, v2, p2)
    stored = pool.gather("a", 0)
    assert torch.equal(stored.k, torch.cat([k1, k2]))
    assert torch.equal(stored.v, torch.cat([v1, v2]))
    assert torch.equal(stored.positions, torch.arange(11))
    assert pool.lengths("a") == [11, 0, 0]
    assert pool.blocks_of("a") == 3  # ceil(11 / 4) in layer 0 only


def test_accounting_in_blocks_and_bytes():
    pool = make_pool(num_blocks=10)
    assert pool.bytes_per_block == 2 * BLOCK * HEADS * DIM * 4
    pool.reserve("a", [5, 4, 1])  # 2 + 1 + 1 blocks
    assert pool.num_used_blocks == 4 and pool.num_free_blocks == 6
    assert pool.used_bytes == 4 * pool.bytes_per_block
    # Reserved blocks count as room: 8 tokens fit layer 0's 2 blocks, 9 need a third.
    assert pool.blocks_needed("a", [8, 0, 0]) == 0
    assert pool.blocks_needed("a", [9, 0, 0]) == 1
    assert pool.free("a") == 4
    assert pool.num_free_blocks == 10


def test_reserve_is_all_or_nothing_and_typed():
    pool = make_pool(num_blocks=5)
    with pytest.raises(KVPoolExhausted, match="need 6 blocks, 5 free") as caught:
        pool.reserve("a", 8)  # 2 blocks in each of 3 layers
    assert (caught.value.blocks_needed, caught.value.blocks_free) == (6, 5)
    assert pool.num_free_blocks == 5 and not pool.has("a")
    pool.reserve("a", 4)  # 3 blocks: fits
    with pytest.raises(KVPoolExhausted):
        pool.append("a", 0, *random_kv(13))  # layer 0 would need 3 more blocks, 2 are free
    assert pool.lengths("a") == [0, 0, 0]


def test_pyramid_shaped_store_and_retain_keep_positions():
    pool = make_pool()
    layers = [LayerKV(*random_kv(n)) for n in (9, 6, 3)]
    pool.store("a", layers)
    assert pool.lengths("a") == [9, 6, 3]
    keep = torch.tensor([0, 2, 7, 8])
    before = pool.num_free_blocks
    pool.retain("a", 0, keep)
    kept = pool.gather("a", 0)
    assert torch.equal(kept.k, layers[0].k[keep]) and torch.equal(kept.positions, keep)
    assert pool.num_free_blocks == before + 2  # 9 tokens (3 blocks) -> 4 tokens (1 block)


def test_paged_view_is_a_sequence_kv_equal_to_dense():
    pool = make_pool()
    view, dense = pool.view("a"), DenseKV(LAYERS)
    for start, count in ((0, 5), (5, 1), (6, 7)):
        k, v, p = random_kv(count, start)
        got = view.extend(1, k, v, p)
        want = dense.extend(1, k, v, p)
        for a, b in zip(got, want):
            assert torch.equal(a, b)


def test_store_rejects_duplicates_and_wrong_layer_count():
    pool = make_pool()
    layers = [LayerKV(*random_kv(2)) for _ in range(LAYERS)]
    pool.store("a", layers)
    with pytest.raises(ValueError, match="already holds KV"):
        pool.store("a", layers)
    with pytest.raises(ValueError, match="cache has 2 layers, the pool 3"):
        pool.store("b", layers[:2])


def test_a_decode_step_writes_and_reads_every_layer_of_a_ragged_batch():
    # Two sequences of different lengths, one of them pyramid-shaped (layers of 7, 3, 4
    # tokens): one begin_decode claims a token everywhere, then each layer writes and reads.
    pool = make_pool()
    caches = {"a": [LayerKV(*random_kv(n)) for n in (7, 3, 4)],
              "b": [LayerKV(*random_kv(n)) for n in (2, 2, 2)]}
    for seq_id, layers in caches.items():
        pool.store(seq_id, layers)
    step = pool.begin_decode(["a", "b"])
    assert pool.lengths("a") == [8, 4, 5] and pool.lengths("b") == [3, 3, 3]
    for layer in range(LAYERS):
        k, v, positions = random_kv(2, start=100)
        pool.write_decode(step, layer, k, v, positions)
        k_pad, v_pad, pos_pad, lengths = pool.read_decode(step, layer)
        for row, seq_id in enumerate(["a", "b"]):
            n = int(lengths[row])
            stored = pool.gather(seq_id, layer)
            assert n == stored.num_tokens
            assert torch.equal(k_pad[row, :n], stored.k) and torch.equal(v_pad[row, :n], stored.v)
            assert torch.equal(pos_pad[row, :n], stored.positions)
            assert torch.equal(stored.k[-1], k[row]) and int(stored.positions[-1]) == 100 + row
            assert torch.equal(stored.k[:-1], caches[seq_id][layer].k)


def test_a_decode_step_that_cannot_get_a_block_changes_nothing_of_that_sequence():
    pool = make_pool(num_blocks=3)
    pool.store("a", [LayerKV(*random_kv(BLOCK)) for _ in range(LAYERS)])  # every block full
    with pytest.raises(KVPoolExhausted):
        pool.begin_decode(["a"])
    assert pool.lengths("a") == [BLOCK] * LAYERS and pool.num_free_blocks == 0
