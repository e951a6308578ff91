"""The paged KV pool: per-layer block tables, exact accounting, typed exhaustion."""

from __future__ import annotations

import pytest
import torch
from baton.kv import DenseKV, KVPool, KVPoolExhausted, LayerKV
from baton.kv.decode_step import group_by_width

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
    keys, positions = pool.keys("a", 0)  # the same without the values
    assert torch.equal(keys, stored.k) and torch.equal(positions, stored.positions)
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


@pytest.mark.parametrize("keep", [[0, 1, 2, 3, 4, 5, 6, 7, 8], [0, 1, 2, 3, 6, 7, 8], [5, 8], [0]])
def test_retain_moves_the_kept_tokens_down_in_order_and_leaves_the_rest(keep):
    """Whatever is dropped (nothing, a batch in the middle, the start), the layer reads back as
    the kept rows of k, v and positions, and another sequence's and layer's tokens stay."""
    pool = make_pool(num_blocks=16)
    mine, other = [LayerKV(*random_kv(9)) for _ in range(LAYERS)], [LayerKV(*random_kv(7)) for _ in range(LAYERS)]
    pool.store("a", mine)
    pool.store("b", other)
    keep = torch.tensor(keep)
    pool.retain("a", 1, keep)
    kept = pool.gather("a", 1)
    assert torch.equal(kept.k, mine[1].k[keep]) and torch.equal(kept.v, mine[1].v[keep])
    assert torch.equal(kept.positions, mine[1].positions[keep])
    for seq_id, layers, layer in (("a", mine, 0), ("b", other, 1)):
        stored = pool.gather(seq_id, layer)
        assert torch.equal(stored.k, layers[layer].k) and torch.equal(stored.v, layers[layer].v)


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
    (group,) = step.groups  # two short sequences: one group
    for layer in range(LAYERS):
        k, v, positions = random_kv(2, start=100)
        step.write(layer, k, v, positions)
        k_pad, v_pad, pos_pad, lengths = step.read(group, layer)
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


def test_group_by_width_starts_a_group_where_padding_would_cost_more_than_a_group():
    assert group_by_width([], 4) == []
    assert group_by_width([3, 3, 4], 4) == [slice(0, 3)]
    # 1, 1, 1 then 10: keeping one group would pad 3 x 9 blocks
    assert group_by_width([1, 1, 1, 10, 10], 4) == [slice(0, 3), slice(3, 5)]
    # out of order stays correct: every sequence is in exactly one group
    groups = group_by_width([10, 1, 10, 1], 4)
    assert [i for g in groups for i in range(g.start, g.stop)] == [0, 1, 2, 3]


def test_a_ragged_decode_batch_is_read_group_by_group_with_every_token_in_place():
    # Lengths of 1 to 60 blocks of 8 KiB: several groups, each padded only to its own widest.
    heads, dim = 4, 64
    pool = KVPool(LAYERS, heads, dim, block_size=BLOCK, num_blocks=1000)
    lengths = [3, 5, 20, 33, 150, 160, 230]

    def random_kv(tokens: int, start: int = 0):
        return torch.randn(tokens, heads, dim), torch.randn(tokens, heads, dim), torch.arange(start, start + tokens)

    for index, n in enumerate(lengths):
        pool.store(f"s{index}", [LayerKV(*random_kv(n)) for _ in range(LAYERS)])
    ids = [f"s{index}" for index in range(len(lengths))]
    step = pool.begin_decode(ids)
    assert len(step.groups) > 1
    assert [r for g in step.groups for r in range(g.rows.start, g.rows.stop)] == list(range(len(ids)))
    for layer in range(LAYERS):
        k, v, positions = random_kv(len(ids), start=1000)
        step.write(layer, k, v, positions)
        for group in step.groups:
            k_pad, v_pad, pos_pad, group_lengths = step.read(group, layer)
            widest = max(lengths[row] + 1 for row in range(group.rows.start, group.rows.stop))
            assert k_pad.shape[1] == pool.blocks_for(widest) * BLOCK
            for b, row in enumerate(range(group.rows.start, group.rows.stop)):
                stored = pool.gather(ids[row], layer)
                n = int(group_lengths[b])
                assert n == lengths[row] + 1
                assert torch.equal(k_pad[b, :n], stored.k) and torch.equal(v_pad[b, :n], stored.v)
                assert torch.equal(pos_pad[b, :n], stored.positions)


def table_rows(step, layer: int, count: int) -> list[list[int]]:
    (group,) = step.groups
    return [row[:count].tolist() for row in group.blocks[layer]]


def test_ungrouped_steps_keep_their_block_tables_up_to_date_as_sequences_grow():
    # One group for a reader of blocks in place; the tables are kept between steps and
    # patched as sequences gain blocks, and built anew when the batch changes.
    pool = make_pool(num_blocks=64)
    for seq_id, n in (("a", 3), ("b", 6)):
        pool.store(seq_id, [LayerKV(*random_kv(n)) for _ in range(LAYERS)])
    for _ in range(2 * BLOCK + 1):  # crosses block boundaries: rows gain blocks
        step = pool.begin_decode(["a", "b"], grouped=False)
        (group,) = step.groups
        assert group.rows == slice(0, 2)
        for layer in range(LAYERS):
            tables = [pool._tables[seq_id][layer].blocks for seq_id in ("a", "b")]
            assert [row[:len(t)] for row, t in zip(table_rows(step, layer, 99), tables)] == tables
            assert group.lengths[layer].tolist() == pool.lengths("a")[layer:layer + 1] + \
                pool.lengths("b")[layer:layer + 1]
    pool.free("a")
    pool.store("c", [LayerKV(*random_kv(1)) for _ in range(LAYERS)])  # may reuse a's blocks
    step = pool.begin_decode(["c", "b"], grouped=False)
    assert table_rows(step, 0, 1)[0] == pool._tables["c"][0].blocks[:1]


def test_an_ungrouped_step_after_pruning_reads_the_new_blocks():
    pool = make_pool(num_blocks=64)
    pool.store("a", [LayerKV(*random_kv(9)) for _ in range(LAYERS)])
    pool.begin_decode(["a"], grouped=False)
    pool.retain("a", 1, torch.tensor([0, 4, 8]))  # PyramidInfer drops tokens of layer 1
    step = pool.begin_decode(["a"], grouped=False)
    blocks = pool._tables["a"][1].blocks
    assert table_rows(step, 1, len(blocks))[0] == blocks
    assert step.groups[0].lengths[1].tolist() == [4]


def test_a_pruned_row_regrows_with_whatever_blocks_it_gets_next():
    """PyramidInfer frees a layer's last blocks; the kept tables are patched, not rebuilt,
    and the blocks the row gains later (others' freed ones here) are the ones read."""
    pool = make_pool(num_blocks=64)
    pool.store("a", [LayerKV(*random_kv(4 * BLOCK - 1)) for _ in range(LAYERS)])
    pool.begin_decode(["a"], grouped=False)
    tables = pool._batch
    pool.retain("a", 1, torch.arange(0, 4 * BLOCK, 4))  # 4 blocks -> 1
    pool.store("b", [LayerKV(*random_kv(3 * BLOCK)) for _ in range(LAYERS)])  # takes them
    for _ in range(3 * BLOCK + 1):  # layer 1 grows past its old 4 blocks again
        step = pool.begin_decode(["a"], grouped=False)
        for layer in range(LAYERS):
            blocks = pool._tables["a"][layer].blocks
            assert table_rows(step, layer, len(blocks))[0] == blocks
    assert pool._batch is tables
    assert len(pool._tables["a"][1].blocks) > 4
