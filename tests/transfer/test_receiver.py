"""Receiving a push into the pool: a cache lands in its blocks when the landing comes early
enough, and is kept whole otherwise; either way the pool holds it exact."""

from __future__ import annotations

import asyncio
import concurrent.futures

import torch
from baton.api.requests import CompressionParams
from baton.kv import KVPool
from baton.kv.dense import LayerKV
from baton.sampling.params import SamplingParams
from baton.transfer import framing, receiver
from baton.transfer.codec import KVSpec, encode_kv
from baton.transfer.handoff import KVHandoff
from baton.transfer.receiver import PoolLanding, receive_body

LAYERS, HEADS, DIM, PROMPT = 3, 2, 8, 200
SPEC = KVSpec("m", "rev", "float32", LAYERS, HEADS, DIM, 512)


def cache() -> list[LayerKV]:
    generator = torch.Generator().manual_seed(1)
    return [LayerKV(torch.randn(n, HEADS, DIM, generator=generator),
                    torch.randn(n, HEADS, DIM, generator=generator), torch.arange(n))
            for n in (PROMPT, 150, 100)]


class Pool:
    """A pool, its landings claimed when the test says so, as an engine claims them between
    steps."""

    def __init__(self) -> None:
        self.pool = KVPool(LAYERS, HEADS, DIM, block_size=16, num_blocks=64)
        self.asked: list[concurrent.futures.Future] = []
        self.given_back: list[concurrent.futures.Future] = []

    def ask(self) -> concurrent.futures.Future:
        self.asked.append(concurrent.futures.Future())
        return self.asked[-1]

    def claim(self) -> None:
        self.asked[-1].set_result(self.pool.land([PROMPT, 150, 100]))

    def give_back(self, landing: concurrent.futures.Future) -> None:
        self.given_back.append(landing)
        self.pool.free(landing.result())


def push(layers, pool: Pool, claim_after_chunks: int):
    encoded = encode_kv(layers, "r", "m", "rev")
    handoff = KVHandoff(encoded.header, tuple(range(PROMPT)), 0, SamplingParams(),
                        CompressionParams())
    sent = [framing.parse(framing.serialize(message))
            for message in framing.messages(handoff, encoded.chunk_pieces(1000))]

    async def messages():
        for index, message in enumerate(sent[1:]):
            if index == claim_after_chunks:
                pool.claim()
            yield message

    landing = PoolLanding("r", pool.ask, pool.give_back)
    return landing, asyncio.run(receive_body(handoff, messages(), SPEC, landing=landing))


def stored(pool: KVPool, seq_id: str) -> list[LayerKV]:
    return [pool.gather(seq_id, layer) for layer in range(LAYERS)]


def assert_same(sent: list[LayerKV], received: list[LayerKV]) -> None:
    for a, b in zip(sent, received, strict=True):
        assert torch.equal(a.k, b.k) and torch.equal(a.v, b.v)
        assert torch.equal(a.positions, b.positions)


def test_a_cache_whose_landing_comes_early_lands_in_the_blocks():
    layers, pool = cache(), Pool()
    _, pushed = push(layers, pool, claim_after_chunks=3)
    assert pushed.landed and not pool.given_back
    free = pool.pool.num_free_blocks  # the landing holds the cache's blocks already
    pool.pool.store("r", pushed.layers)
    assert pool.pool.num_free_blocks == free
    assert_same(layers, stored(pool.pool, "r"))


def test_a_landing_after_too_many_bytes_is_given_back_and_the_cache_kept(monkeypatch):
    monkeypatch.setattr(receiver, "LANDING_CATCH_UP_BYTES", 5000)
    layers, pool = cache(), Pool()
    free = pool.pool.num_free_blocks
    _, pushed = push(layers, pool, claim_after_chunks=10)  # 10 000 bytes arrived before it
    assert not pushed.landed and pool.given_back == pool.asked
    assert pool.pool.num_free_blocks == free
    pool.pool.store("r", pushed.layers)
    assert_same(layers, stored(pool.pool, "r"))


def test_a_landing_that_comes_after_the_last_byte_changes_nothing():
    layers, pool = cache(), Pool()
    landing, pushed = push(layers, pool, claim_after_chunks=10**6)  # not before the end
    assert not pushed.landed
    pool.claim()
    landing.release()  # what the pod does with a landing it did not use
    assert pool.given_back == pool.asked and pool.pool.num_free_blocks == pool.pool.num_blocks
    pool.pool.store("r", pushed.layers)
    assert_same(layers, stored(pool.pool, "r"))
