"""baton's decode kernel (each build's that this CPU runs) reads each sequence's blocks of the
paged cache where they lie and equals attention over the gathered blocks."""

from __future__ import annotations

import pytest
import torch
from baton.kernels import cpu as cpu_kernels
from kernel_builds import kernels_fixture
from test_cpu_attention import reference

kernels = kernels_fixture("paged_decode_attention")


def paged_reference(q, k_cache, v_cache, tables, lengths):
    """fp64: each row's new token over its first lengths[b] slots, in table order."""
    num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
    outs = []
    for b in range(q.shape[0]):
        length = int(lengths[b])
        keys = k_cache[tables[b]].reshape(-1, num_kv_heads, head_dim)[:length]
        values = v_cache[tables[b]].reshape(-1, num_kv_heads, head_dim)[:length]
        outs.append(reference(q[b:b + 1], keys, values)[0])
    return torch.stack(outs)


def paged_case(heads, kv_heads, head_dim, dtype, block_size=16, seed=0):
    generator = torch.Generator().manual_seed(seed)
    lengths = torch.tensor([1, 5, 16, 17, 100, 333, 160])
    width = -(-int(lengths.max()) // block_size)
    num_blocks = len(lengths) * width + 3
    shape = (num_blocks, block_size, kv_heads, head_dim)
    k_cache = torch.randn(shape, generator=generator).to(dtype)
    v_cache = torch.randn(shape, generator=generator).to(dtype)
    tables = torch.randperm(num_blocks, generator=generator)[:len(lengths) * width].view(len(lengths), width)
    q = torch.randn(len(lengths), heads, head_dim, generator=generator).to(dtype)
    return q, k_cache, v_cache, tables, lengths


@pytest.mark.parametrize("head_dim", cpu_kernels.HEAD_DIMS)
@pytest.mark.parametrize("heads", [(8, 8), (8, 2), (8, 1), (12, 4), (32, 2)])
@pytest.mark.parametrize("dtype", cpu_kernels.DTYPES)
def test_paged_decode_equals_attention_over_the_gathered_blocks(kernels, head_dim, heads, dtype):
    q, k_cache, v_cache, tables, lengths = paged_case(*heads, head_dim, dtype, seed=head_dim)
    out = kernels.paged_decode_attention(q, k_cache, v_cache, tables, lengths)
    assert out.dtype == dtype
    error = (out.double() - paged_reference(q, k_cache, v_cache, tables, lengths)).abs().max()
    # fp32: rounding; bf16: the output's own rounding (probabilities stay fp32 here)
    assert error < (2e-6 if dtype == torch.float32 else 1e-2), error


@pytest.mark.parametrize("block_size", [1, 5, 16, 32])
def test_paged_decode_takes_any_block_size(kernels, block_size):
    q, k_cache, v_cache, tables, lengths = paged_case(8, 2, 32, torch.float32, block_size, seed=block_size)
    out = kernels.paged_decode_attention(q, k_cache, v_cache, tables, lengths)
    assert (out.double() - paged_reference(q, k_cache, v_cache, tables, lengths)).abs().max() < 2e-6


def test_paged_decode_refuses_a_length_beyond_its_table(kernels):
    q, k_cache, v_cache, tables, lengths = paged_case(8, 2, 32, torch.float32)
    lengths[3] = tables.shape[1] * k_cache.shape[1] + 1
    with pytest.raises(RuntimeError, match=f"length {int(lengths[3])} of sequence 3"):
        kernels.paged_decode_attention(q, k_cache, v_cache, tables, lengths)
    with pytest.raises(RuntimeError, match="int64"):
        kernels.paged_decode_attention(q, k_cache, v_cache, tables.int(), lengths)
