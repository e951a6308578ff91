"""The rule a chain's break-even comes from: its measured compute, plus its KV's transfer and
its extra hop. A slower link or a longer hop moves the break-even out (to beyond what was
measured when the chain never wins); compression, which halves the bytes, brings it back;
the bytes per token are what PushKV really carries."""

from __future__ import annotations

import math

import pytest
import torch
from baton.kv.dense import LayerKV
from baton.runahead import PartitionTable
from baton.runahead.break_even import (
    COMPUTE_ONLY,
    Link,
    break_even,
    chain_ttft_s,
    kv_bytes_per_token,
)
from baton.runahead.table import TableEntry
from baton.transfer.codec import encode_kv

# (tokens, one process s, chain s): the chain saves 10% of the compute from 2048 tokens on
POINTS = [(1024, 0.10, 0.11), (2048, 0.20, 0.18), (4096, 0.40, 0.36), (8192, 0.80, 0.72)]
PER_TOKEN = 100_000.0  # bytes


def test_on_compute_alone_the_chain_pays_from_where_it_wins_for_good():
    assert break_even(POINTS) == 2048
    assert break_even(reversed(POINTS)) == 2048  # any order


def test_the_kv_transfer_moves_the_break_even_out_and_compression_brings_it_back():
    fast = Link(bytes_per_s=20e9)  # 2048 tokens: 10 ms of transfer, less than the 20 ms saved
    assert break_even(POINTS, PER_TOKEN, fast) == 2048
    slow = Link(bytes_per_s=5e9)  # 2048: 41 ms > 20 ms saved; 4096: 82 > 40; never
    assert break_even(POINTS, PER_TOKEN, slow) == 2 * 8192, "beyond what was measured"
    middle = Link(bytes_per_s=10e9)  # 2048 tokens: 20.5 ms > 20 saved; 4096: 41 > 40
    assert break_even(POINTS, PER_TOKEN, middle) == 16384
    assert break_even(POINTS, PER_TOKEN / 2, middle) == 2048  # half the bytes kept


def test_the_chains_extra_hop_counts_at_every_length():
    assert break_even(POINTS, 0.0, Link(extra_hop_s=0.015)) == 2048  # 20 ms saved at 2048 > 15
    assert break_even(POINTS, 0.0, Link(extra_hop_s=0.025)) == 4096
    assert break_even(POINTS, 0.0, Link(extra_hop_s=0.09)) == 16384


def test_a_chain_ttft_adds_the_hop_and_the_bytes_over_the_link():
    link = Link(bytes_per_s=1e9, extra_hop_s=0.002)
    assert chain_ttft_s(0.5, 1000, 1e3, link) == pytest.approx(0.5 + 0.002 + 0.001)
    assert chain_ttft_s(0.5, 1000, 1e3, COMPUTE_ONLY) == 0.5


def test_bytes_per_token_are_what_pushkv_carries():
    layers, heads, dim, tokens = 3, 2, 8, 10
    cache = [LayerKV(torch.zeros(tokens, heads, dim, dtype=torch.bfloat16),
                     torch.zeros(tokens, heads, dim, dtype=torch.bfloat16), torch.arange(tokens))
             for _ in range(layers)]
    payload = encode_kv(cache, "r", "m", "rev").header.total_bytes
    assert kv_bytes_per_token(layers, heads, dim, 2) * tokens == payload
    assert kv_bytes_per_token(layers, heads, dim, 2, kept=0.5) * tokens == payload / 2


@pytest.mark.parametrize("link, says", [({"bytes_per_s": 0}, "bandwidth"),
                                        ({"extra_hop_s": -1}, "extra hop"),
                                        ({"extra_hop_s": math.nan}, "extra hop")])
def test_a_link_that_cannot_be_is_refused(link, says):
    with pytest.raises(ValueError, match=says):
        Link(**link)


def test_a_table_applies_the_rule_to_its_measured_entries():
    table = PartitionTable("t", measured_on={"device": "cpu"}, min_context={2: 2048})
    for tokens, single_s, chain_s in POINTS:
        table.put(TableEntry(2, tokens, [0.5, 1.0], chain_s, chain_s, single_s))
    assert table.break_even(2, "cpu") == 2048 == table.min_context[2]
    assert table.break_even(2, "cpu", PER_TOKEN, Link(bytes_per_s=5e9)) == 16384
    assert table.break_even(2, "cuda", PER_TOKEN, Link(bytes_per_s=5e9)) == 0  # not measured there
