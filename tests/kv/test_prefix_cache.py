"""The prefix cache's bookkeeping in the KV pool: hashes, sharing, references, LRU eviction."""

from __future__ import annotations

import torch
from baton.kv import KVPool
from baton.kv.prefix_cache import cache_root, extend_block_hashes

LAYERS, BLOCK = 2, 4


def make_pool(num_blocks: int = 16) -> KVPool:
    return KVPool(LAYERS, 1, 2, block_size=BLOCK, num_blocks=num_blocks, cache_prefixes=True)


def fill(pool: KVPool, seq_id: str, num_tokens: int, value: float) -> None:
    """Write ``num_tokens`` tokens of a constant to every layer of a sequence."""
    pool.reserve(seq_id, num_tokens)
    for layer in range(LAYERS):
        kv = torch.full((num_tokens, 1, 2), value)
        pool.append(seq_id, layer, kv, kv, torch.arange(num_tokens))


def hashes_of(tokens: list[int], salt: str = "") -> list[bytes]:
    return extend_block_hashes([], tokens, BLOCK, cache_root("rev", "torch.float32", salt))


def test_a_hash_names_everything_before_it_and_who_may_see_it():
    tokens = list(range(12))
    base = hashes_of(tokens)
    assert len(base) == 3 and len(set(base)) == 3
    assert hashes_of(tokens[:9]) == base[:2], "a partial block has no hash"
    changed = hashes_of([99] + tokens[1:])
    assert all(a != b for a, b in zip(changed, base)), "a change reaches every later block"
    assert not set(hashes_of(tokens, salt="tenant-b")) & set(base)
    other_revision = extend_block_hashes([], tokens, BLOCK, cache_root("rev2", "torch.float32"))
    other_dtype = extend_block_hashes([], tokens, BLOCK, cache_root("rev", "torch.bfloat16"))
    assert not (set(other_revision) | set(other_dtype)) & set(base)
    assert extend_block_hashes(base[:1], tokens, BLOCK, b"ignored once started") == base


def test_blocks_outlive_their_request_and_are_shared_read_only():
    pool = make_pool()
    fill(pool, "a", 10, 1.0)  # 2 full blocks and a partial one per layer
    hashes = hashes_of(list(range(10)))
    assert pool.cache_blocks("a", hashes) == 2
    assert pool.prefix_cache.num_cached_blocks == 2
    pool.free("a")
    # The partial block went back; the cached ones stay, evictable, counted as free.
    assert pool.num_free_blocks == pool.num_blocks and pool.num_used_blocks == 0
    found = pool.match_prefix(hashes_of(list(range(10)) + [7, 7]))
    assert len(found) == 2
    pool.attach_prefix("b", found)
    assert pool.lengths("b") == [8, 8]
    assert pool.num_used_blocks == 2 * LAYERS
    kv = torch.full((3, 1, 2), 5.0)
    for layer in range(LAYERS):
        pool.append("b", layer, kv, kv, torch.arange(8, 11))
        stored = pool.gather("b", layer)
        assert stored.k[:8].eq(1.0).all() and stored.k[8:].eq(5.0).all()
        assert stored.positions.tolist() == list(range(11))
    pool.attach_prefix("c", found)  # a second reader of the same blocks
    pool.free("b")
    assert pool.gather("c", 0).k.eq(1.0).all(), "freeing one reader leaves the blocks to the other"
    pool.free("c")
    assert pool.num_free_blocks == pool.num_blocks


def test_the_pool_takes_back_the_least_recently_used_blocks_only_when_it_runs_dry():
    pool = make_pool(num_blocks=8)  # 4 blocks of 4 tokens per layer
    for seq_id, value in (("old", 1.0), ("new", 2.0)):
        fill(pool, seq_id, 8, value)
        pool.cache_blocks(seq_id, hashes_of([int(value)] * 8))
        pool.free(seq_id)
    assert pool.prefix_cache.num_cached_blocks == 4 and pool.num_free_blocks == 8
    fill(pool, "x", 4, 3.0)  # one block per layer: the pool's free list is empty, evict one
    stats = pool.prefix_cache.stats
    assert stats.evicted == 1
    # The old prefix's tail went first: its head is still found, the new prefix whole.
    assert len(pool.match_prefix(hashes_of([1] * 8))) == 1
    assert len(pool.match_prefix(hashes_of([2] * 8))) == 2
    held = pool.match_prefix(hashes_of([2] * 8))
    pool.attach_prefix("reader", held)
    fill(pool, "y", 4, 4.0)  # takes the old head; the held blocks are never taken
    assert len(pool.match_prefix(hashes_of([1] * 8))) == 0
    assert pool.num_free_blocks == 0
    assert pool.gather("reader", 1).k.eq(2.0).all()
    events = pool.prefix_cache.events_after(0)
    assert [e.sequence for e in events] == list(range(1, len(events) + 1))
    assert [e.stored for e in events] == [True] * 4 + [False] * 2


def test_a_block_computed_twice_stays_private_to_the_second_writer():
    pool = make_pool()
    tokens = list(range(8))
    fill(pool, "a", 8, 1.0)
    fill(pool, "b", 8, 1.0)
    assert pool.cache_blocks("a", hashes_of(tokens)) == 2
    assert pool.cache_blocks("b", hashes_of(tokens)) == 0
    pool.free("a")
    pool.free("b")
    assert pool.num_free_blocks == pool.num_blocks
    assert pool.prefix_cache.num_cached_blocks == 2


def test_without_a_cache_nothing_is_kept():
    pool = KVPool(LAYERS, 1, 2, block_size=BLOCK, num_blocks=16)
    fill(pool, "a", 8, 1.0)
    assert pool.cache_blocks("a", hashes_of(list(range(8)))) == 0
    assert pool.match_prefix(hashes_of(list(range(8)))) == []
    pool.free("a")
    assert pool.num_free_blocks == 16
