"""attend(): every kernel path (grouped GQA, split prefix-then-own, masked) equals plain softmax
attention under the position mask."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from baton.model.attention import (
    MAX_GROUPED_QUERIES,
    _prefix_then_own,
    attend,
    expand_kv_heads,
    visibility_mask,
)


def masked_reference(q, k, v, query_positions, key_positions):
    """Plain softmax attention under visibility_mask, in float64: [T, H, D]."""
    keys = expand_kv_heads(k, q.shape[1]).double().transpose(0, 1)
    values = expand_kv_heads(v, q.shape[1]).double().transpose(0, 1)
    scores = q.double().transpose(0, 1) @ keys.transpose(1, 2) / q.shape[-1] ** 0.5
    scores = scores.masked_fill(~visibility_mask(query_positions, key_positions, None), float("-inf"))
    return (F.softmax(scores, dim=-1) @ values).transpose(0, 1).float()


def random_qkv(num_queries, num_keys, heads=4, kv_heads=2, head_dim=16, seed=0):
    generator = torch.Generator().manual_seed(seed)
    q = torch.randn(num_queries, heads, head_dim, generator=generator)
    k = torch.randn(num_keys, kv_heads, head_dim, generator=generator)
    v = torch.randn(num_keys, kv_heads, head_dim, generator=generator)
    return q, k, v


@pytest.mark.parametrize(("prefix", "own"), [
    (1, 1), (5, 3), (64, 64), (300, 37), (37, 300),  # grouped query heads under a mask
    (1, MAX_GROUPED_QUERIES + 1), (300, 700),  # two fused kernels merged by log-sum-exp
])
def test_chain_rank_slice_over_its_prefix(prefix, own):
    # A chain rank or a SARATHI chunk: keys 0..prefix-1 received, then its own slice.
    q, k, v = random_qkv(own, prefix + own, seed=prefix + own)
    key_positions = torch.arange(prefix + own)
    query_positions = key_positions[prefix:]
    assert _prefix_then_own(query_positions, key_positions)
    out = attend(q, k, v, query_positions, key_positions)
    assert (out - masked_reference(q, k, v, query_positions, key_positions)).abs().max() < 1e-5


@pytest.mark.parametrize("own", [20, MAX_GROUPED_QUERIES + 20])
def test_pruned_prefix_keeps_its_positions(own):
    # PyramidInfer dropped prefix tokens: positions have gaps, all before the new tokens.
    q, k, v = random_qkv(own, 30 + own, seed=3)
    prefix_positions = torch.tensor(sorted(torch.randperm(90)[:30].tolist()))
    query_positions = torch.arange(100, 100 + own)
    key_positions = torch.cat([prefix_positions, query_positions])
    assert _prefix_then_own(query_positions, key_positions)
    out = attend(q, k, v, query_positions, key_positions)
    assert (out - masked_reference(q, k, v, query_positions, key_positions)).abs().max() < 1e-5


@pytest.mark.parametrize("own", [3, MAX_GROUPED_QUERIES + 3])
def test_keys_that_are_not_prefix_then_own_take_the_masked_path(own):
    # A prefix key after a query: the split kernel's assumption fails, a mask is used.
    query_positions = torch.arange(5, 5 + own)
    key_positions = torch.cat([torch.tensor([0, 1, 5 + own + 4]), query_positions])
    assert not _prefix_then_own(query_positions, key_positions)
    q, k, v = random_qkv(own, own + 3, seed=4)
    out = attend(q, k, v, query_positions, key_positions)
    assert (out - masked_reference(q, k, v, query_positions, key_positions)).abs().max() < 1e-5


@pytest.mark.parametrize("heads", [(8, 8), (8, 2), (8, 1)])  # MHA, GQA, MQA
def test_grouped_path_for_every_head_layout(heads):
    num_heads, num_kv_heads = heads
    q, k, v = random_qkv(9, 40, heads=num_heads, kv_heads=num_kv_heads, seed=5)
    key_positions = torch.arange(40)
    out = attend(q, k, v, key_positions[31:], key_positions)
    assert (out - masked_reference(q, k, v, key_positions[31:], key_positions)).abs().max() < 1e-5
