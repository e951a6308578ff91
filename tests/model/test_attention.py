"""attend(): the prefix-then-own fast path equals attention under the explicit position mask."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from baton.model.attention import _prefix_then_own, attend, expand_kv_heads, visibility_mask


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


@pytest.mark.parametrize(("prefix", "own"), [(1, 1), (5, 3), (64, 64), (300, 37), (37, 300)])
def test_chain_rank_slice_over_its_prefix(prefix, own):
    # A chain rank or a SARATHI chunk: keys 0..prefix-1 received, then its own slice.
    q, k, v = random_qkv(own, prefix + own, seed=prefix + own)
    key_positions = torch.arange(prefix + own)
    query_positions = key_positions[prefix:]
    assert _prefix_then_own(query_positions, key_positions)
    out = attend(q, k, v, query_positions, key_positions)
    assert (out - masked_reference(q, k, v, query_positions, key_positions)).abs().max() < 1e-5


def test_pruned_prefix_keeps_its_positions():
    # PyramidInfer dropped prefix tokens: positions have gaps, all before the new tokens.
    q, k, v = random_qkv(20, 50, seed=3)
    prefix_positions = torch.tensor(sorted(torch.randperm(90)[:30].tolist()))
    query_positions = torch.arange(100, 120)
    key_positions = torch.cat([prefix_positions, query_positions])
    assert _prefix_then_own(query_positions, key_positions)
    out = attend(q, k, v, query_positions, key_positions)
    assert (out - masked_reference(q, k, v, query_positions, key_positions)).abs().max() < 1e-5


def test_keys_that_are_not_prefix_then_own_take_the_masked_path():
    # A prefix key after a query: the fast path's assumption fails, the explicit mask is used.
    key_positions = torch.tensor([0, 1, 9, 5, 6, 7])
    query_positions = torch.tensor([5, 6, 7])
    assert not _prefix_then_own(query_positions, key_positions)
    q, k, v = random_qkv(3, 6, seed=4)
    out = attend(q, k, v, query_positions, key_positions)
    assert (out - masked_reference(q, k, v, query_positions, key_positions)).abs().max() < 1e-5
