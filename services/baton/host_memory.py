"""Host memory for large CPU tensors: kept inside the process between forwards
(``keep_freed_memory``), and backed by huge pages where it is read at random
(``huge_page_zeros``).

glibc's malloc serves every allocation above its mmap threshold (128 KiB, rising
to at most 32 MiB as it adapts) with a fresh ``mmap`` and returns it to the
kernel on free, so each forward's large intermediates (a 4096-token chunk's MLP
activations are ~20 MiB) would be page-faulted in anew, page by page. Raising the
mmap and trim thresholds serves them from the heap, where freed memory is reused. vLLM's CPU backend gets the same by preloading tcmalloc.

The setting is process-wide and harmless elsewhere; it is applied once, when
the first model is built, and only where glibc's ``mallopt`` exists.

The KV pool is read at random: a decode step walks every running sequence's
blocks, each a few KiB somewhere in hundreds of MiB. In 4 KiB pages every block
is a page of its own and a TLB miss; Linux backs a region with 2 MiB pages only
where it is asked to (``transparent_hugepage`` is ``madvise`` on Debian, Ubuntu
and most cloud images). What either costs or saves: docs/runtime.md.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import math
import mmap

import torch

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
# glibc caps the mmap threshold at 32 MiB on 64-bit machines (HEAP_MAX_SIZE / 2).
MMAP_THRESHOLD_BYTES = 32 * 2**20
TRIM_THRESHOLD_BYTES = 1 * 2**30


@functools.cache
def keep_freed_memory() -> bool:
    """Apply the thresholds; returns whether the C library took them."""
    name = ctypes.util.find_library("c")
    if name is None:
        return False
    try:
        mallopt = ctypes.CDLL(name).mallopt
    except (OSError, AttributeError):
        return False  # not glibc (musl, macOS): nothing to tune
    return bool(mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES)
                and mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES))


HUGE_PAGE_BYTES = 2 * 2**20


def huge_page_zeros(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """``torch.zeros(shape, dtype=dtype)`` on the CPU, in an anonymous mapping the kernel is
    asked to back with transparent huge pages (2 MiB aligned, every page faulted in now as
    ``torch.zeros`` would). Below one huge page, or where the kernel refuses, plain
    ``torch.zeros``. The mapping lives as long as the tensor (``torch.frombuffer`` holds it)."""
    count = math.prod(shape)
    num_bytes = count * dtype.itemsize
    if num_bytes < HUGE_PAGE_BYTES or not hasattr(mmap, "MADV_HUGEPAGE"):
        return torch.zeros(shape, dtype=dtype)
    mapping = mmap.mmap(-1, num_bytes + HUGE_PAGE_BYTES, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    start = ctypes.addressof(ctypes.c_char.from_buffer(mapping))
    offset = -start % HUGE_PAGE_BYTES
    try:
        mapping.madvise(mmap.MADV_HUGEPAGE, offset, num_bytes)
    except OSError:  # transparent huge pages compiled out or disabled: small pages it is
        mapping.close()
        return torch.zeros(shape, dtype=dtype)
    tensor = torch.frombuffer(mapping, dtype=dtype, count=count, offset=offset).view(shape)
    return tensor.zero_()
