"""An fp8 pool: its blocks hold one byte per element (half of bf16's), every way in stores
through the same scale, and every way out reads back in the compute dtype."""

from __future__ import annotations

import pytest
import torch
from baton.kv import KVPool
from baton.kv.storage import KVStorage, kv_storage

FP8 = [torch.float8_e4m3fn, torch.float8_e5m2]


def pools(dtype: torch.dtype, scale: float = 1.0):
    shape = (2, 2, 8, 4, 16)  # layers, kv heads, head dim, block size, blocks
    return (KVPool(*shape, dtype=torch.bfloat16),
            KVPool(*shape, dtype=torch.bfloat16, storage=KVStorage(dtype, scale)))


@pytest.mark.parametrize("dtype", FP8)
def test_an_fp8_pool_stores_fp8_in_half_the_bytes_of_bf16(dtype):
    bf16, fp8 = pools(dtype)
    assert fp8.k_cache.dtype == fp8.v_cache.dtype == dtype
    assert fp8.bytes_per_block * 2 == bf16.bytes_per_block
    assert kv_storage("auto", 1.0, torch.bfloat16) == KVStorage(torch.bfloat16)
    assert kv_storage("fp8_e4m3", 0.5, torch.bfloat16) == KVStorage(torch.float8_e4m3fn, 0.5)


@pytest.mark.parametrize("dtype", FP8)
@pytest.mark.parametrize("scale", [1.0, 0.25])
def test_every_write_stores_fp8_and_every_read_returns_the_compute_dtype(dtype, scale):
    _, pool = pools(dtype, scale)
    torch.manual_seed(0)
    k, v = torch.randn(6, 2, 8, dtype=torch.bfloat16), torch.randn(6, 2, 8, dtype=torch.bfloat16)
    pool.append("a", 0, k, v, torch.arange(6))  # a stored cache
    segment = pool.prefill_segment("b", 6)  # a prefill chunk, then a second one
    segment.extend(0, k, v, torch.arange(6))
    step = pool.begin_decode(["b"])  # a decode step
    step.write(0, k[:1], v[:1], torch.tensor([6]))
    tolerance = 0.07 if dtype == torch.float8_e4m3fn else 0.13  # relative: 3 or 2 mantissa bits
    for seq_id, expected in (("a", k), ("b", torch.cat([k, k[:1]]))):
        stored = pool.gather(seq_id, 0)
        assert stored.k.dtype == torch.bfloat16
        assert torch.allclose(stored.k.float(), expected.float(), rtol=tolerance, atol=1e-2)
        assert not torch.equal(stored.k, expected)  # it went through fp8
    raw = pool.k_cache.view(-1, 2, 8)[:6].float() * scale  # the bytes are k / scale
    assert torch.allclose(raw, k.float(), rtol=tolerance, atol=1e-2)
    k_pad, _, _, _ = step.read(step.groups[0], 0, dtype=torch.bfloat16)
    assert k_pad.dtype == torch.bfloat16


def test_values_past_fp8s_range_saturate_instead_of_becoming_nan():
    storage = KVStorage(torch.float8_e4m3fn)
    stored = storage.store(torch.tensor([1000.0, -1000.0, 1.0]))
    assert storage.load(stored, torch.float32).tolist() == [448.0, -448.0, 1.0]
    with pytest.raises(ValueError, match="scale must be > 0"):
        KVStorage(torch.float8_e4m3fn, 0.0)


def test_pruning_moves_fp8_tokens_as_they_are():
    _, pool = pools(torch.float8_e4m3fn)
    k = torch.randn(8, 2, 8, dtype=torch.bfloat16)
    pool.append("a", 0, k, k, torch.arange(8))
    before = pool.gather("a", 0)
    pool.retain("a", 0, torch.tensor([1, 5, 6]))
    after = pool.gather("a", 0)
    assert torch.equal(after.k, before.k[[1, 5, 6]])
    assert after.positions.tolist() == [1, 5, 6]
