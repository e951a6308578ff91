"""Huge-page host memory for the KV pool: zeros like torch.zeros, 2 MiB aligned, backed by
huge pages where the kernel offers them, and unmapped with the tensor."""

from __future__ import annotations

import gc
from pathlib import Path

import pytest
import torch
from baton.host_memory import HUGE_PAGE_BYTES, huge_page_zeros
from baton.kv import KVPool

THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def huge_pages_offered() -> bool:
    return THP.exists() and "[never]" not in THP.read_text()


def mapping_of(address: int) -> tuple[int, int] | None:
    """The [start, end) of this process's mapping that holds ``address``."""
    for line in Path("/proc/self/maps").read_text().splitlines():
        start, end = (int(x, 16) for x in line.split()[0].split("-"))
        if start <= address < end:
            return start, end
    return None


def anon_huge_kib(address: int) -> int:
    """AnonHugePages of the mapping that holds ``address`` (from /proc/self/smaps)."""
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        fields = line.split()
        if "-" in fields[0] and not fields[0].endswith(":"):
            start, end = (int(x, 16) for x in fields[0].split("-"))
            inside = start <= address < end
        elif inside and fields[0] == "AnonHugePages:":
            return int(fields[1])
    raise AssertionError(f"no mapping holds {address:#x}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_large_tensors_are_zeros_aligned_to_a_huge_page_and_writable(dtype):
    shape = (300, 16, 2, 128)  # ~4.9 MB in fp32
    tensor = huge_page_zeros(shape, dtype)
    assert tensor.shape == shape and tensor.dtype == dtype and tensor.is_contiguous()
    assert torch.count_nonzero(tensor) == 0
    assert tensor.data_ptr() % HUGE_PAGE_BYTES == 0
    tensor[7, 3] = 1.5
    assert tensor.sum().item() == 1.5 * 2 * 128


def test_small_tensors_are_plain_zeros():
    tensor = huge_page_zeros((4, 4), torch.float32)
    assert torch.equal(tensor, torch.zeros(4, 4))


@pytest.mark.skipif(not huge_pages_offered(), reason="transparent huge pages are off here")
def test_the_kernel_backs_it_with_huge_pages():
    tensor = huge_page_zeros((8 * HUGE_PAGE_BYTES // 4,), torch.float32)
    assert anon_huge_kib(tensor.data_ptr()) >= HUGE_PAGE_BYTES // 1024


def test_the_mapping_goes_with_the_tensor():
    tensor = huge_page_zeros((2 * HUGE_PAGE_BYTES // 4,), torch.float32)
    address = tensor.data_ptr()
    assert mapping_of(address) is not None
    view = tensor[10:]
    del tensor
    gc.collect()
    assert mapping_of(address) is not None  # a view keeps it
    del view
    gc.collect()
    assert mapping_of(address) is None


def test_a_cpu_pool_keeps_its_cache_in_huge_page_memory():
    pool = KVPool(num_layers=2, num_kv_heads=2, head_dim=32, block_size=16, num_blocks=1024)
    for cache in (pool.k_cache, pool.v_cache):
        assert cache.data_ptr() % HUGE_PAGE_BYTES == 0
        assert torch.count_nonzero(cache) == 0
