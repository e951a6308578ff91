"""baton's CPU kernel for PyramidInfer's scores equals the definition (an fp64 loop over
queries and heads) as closely as torch's ops do, on every head layout, head size, dtype,
pruned key set and sliding window; and recent_attention_scores takes it on the CPU."""

from __future__ import annotations

import math

import pytest
import torch
from baton.kernels import cpu as cpu_kernels
from baton.pyramid import scoring
from baton.pyramid.scoring import recent_attention_scores, recent_attention_scores_torch
from kernel_builds import kernels_fixture

kernels = kernels_fixture("attention_scores")  # the AVX-512 builds'


def reference(q, query_positions, weights, k, key_positions, window=None):
    """score[s] = sum_r w_r / H * sum_h softmax over the keys query r sees, in fp64."""
    heads, kv_heads = q.shape[1], k.shape[1]
    scores = torch.zeros(k.shape[0], dtype=torch.float64)
    for row in range(q.shape[0]):
        delta = int(query_positions[row]) - key_positions
        seen = (delta >= 0) & ((delta < window) if window else True)
        for head in range(heads):
            kv_head = head // (heads // kv_heads)
            logits = k[seen, kv_head].double() @ q[row, head].double() / math.sqrt(q.shape[2])
            scores[seen] += float(weights[row]) / heads * torch.softmax(logits, 0)
    return scores


def case(num_queries, num_keys, heads, kv_heads, head_dim, dtype, seed, gaps=True):
    """Recent queries at the end of a (pruned, when ``gaps``) key set, as the selector sees them."""
    generator = torch.Generator().manual_seed(seed)
    q = torch.randn(num_queries, heads, head_dim, generator=generator).to(dtype)
    k = torch.randn(num_keys, kv_heads, head_dim, generator=generator).to(dtype)
    if gaps:  # a pruned layer: sorted positions with holes
        key_positions = torch.randperm(2 * num_keys, generator=generator)[:num_keys].sort().values
    else:
        key_positions = torch.arange(num_keys)
    query_positions = key_positions[-num_queries:]  # each query sees itself and what is older
    weights = 1.0 + 0.2 * torch.rand(num_queries, generator=generator)
    return q, query_positions.contiguous(), weights, k, key_positions


SHAPES = [(1, 1), (1, 17), (5, 16), (16, 33), (64, 300), (102, 511), (20, 1000)]


@pytest.mark.parametrize("dtype", cpu_kernels.DTYPES)
@pytest.mark.parametrize("head_dim", cpu_kernels.HEAD_DIMS)
@pytest.mark.parametrize(("num_queries", "num_keys"), SHAPES)
def test_as_exact_as_torchs_ops(kernels, dtype, head_dim, num_queries, num_keys):
    inputs = case(num_queries, num_keys, 8, 2, head_dim, dtype, seed=num_keys + head_dim)
    truth = reference(*inputs)
    ours = (kernels.attention_scores(*inputs, 0).double() - truth).abs().max().item()
    theirs = (recent_attention_scores_torch(*inputs).double() - truth).abs().max().item()
    # fp32 sums in another order; both upcast bf16 inputs, so bf16 is as exact as fp32
    assert ours <= 2 * theirs + 1e-6, (ours, theirs)


@pytest.mark.parametrize("heads", [(8, 8), (8, 2), (8, 1), (12, 4), (32, 2)])
@pytest.mark.parametrize("window", [None, 7, 64])
def test_every_head_layout_and_sliding_window(kernels, heads, window):
    inputs = case(40, 150, *heads, 32, torch.float32, seed=sum(heads), gaps=False)
    out = kernels.attention_scores(*inputs, window or 0)
    assert (out.double() - reference(*inputs, window)).abs().max() < 1e-6
    if window:  # keys older than every query's window get nothing
        assert out[:150 - 40 - window].abs().max() == 0


def test_a_query_that_sees_no_key_adds_nothing(kernels):
    q, query_positions, weights, k, key_positions = case(3, 20, 8, 2, 32, torch.float32, seed=4)
    key_positions = key_positions + 1000  # every key after every query
    out = kernels.attention_scores(q, query_positions, weights, k, key_positions, 0)
    assert torch.equal(out, torch.zeros(20))


def test_recent_attention_scores_takes_the_kernel(kernels, monkeypatch):
    calls = []
    real = kernels.attention_scores

    class Spy:
        def attention_scores(self, *args):
            calls.append(args[0].shape)
            return real(*args)

    monkeypatch.setattr(scoring.cpu_kernels, "kernels", lambda: Spy())
    monkeypatch.setattr(scoring.cpu_kernels, "has", lambda name: hasattr(kernels, name))
    q, query_positions, weights, k, key_positions = case(10, 50, 8, 2, 32, torch.bfloat16, seed=6)
    out = recent_attention_scores(q, query_positions, weights, k, key_positions)
    assert calls == [q.shape] and out.dtype == torch.float32
    # a query head count the kernel does not take (17 per KV head) goes to torch's ops
    wide = torch.randn(10, 34, 32).to(torch.bfloat16)
    recent_attention_scores(wide, query_positions, weights, k, key_positions)
    assert len(calls) == 1


def test_bad_inputs_are_refused_with_the_value(kernels):
    q, query_positions, weights, k, key_positions = case(4, 8, 8, 2, 32, torch.float32, seed=2)
    with pytest.raises(RuntimeError, match="head_dim 16"):
        kernels.attention_scores(q[..., :16].contiguous(), query_positions, weights,
                                k[..., :16].contiguous(), key_positions, 0)
    with pytest.raises(RuntimeError, match="share a dtype"):
        kernels.attention_scores(q, query_positions, weights, k.double(), key_positions, 0)
    with pytest.raises(RuntimeError, match="query_positions"):
        kernels.attention_scores(q, query_positions.int(), weights, k, key_positions, 0)
    with pytest.raises(RuntimeError, match="sliding_window must be >= 0.*-3"):
        kernels.attention_scores(q, query_positions, weights, k, key_positions, -3)
