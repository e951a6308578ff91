"""Keep the memory of large CPU tensors inside the process between forwards.

glibc's malloc serves every allocation above its mmap threshold (128 KiB, rising
to at most 32 MiB as it adapts) with a fresh ``mmap`` and returns it to the
kernel on free, so each forward's large intermediates (a 4096-token chunk's MLP
activations are ~20 MiB) are page-faulted in anew, page by page: on the
development machines that made a prefill's MLP block take 28 ms instead of 16.
Raising the mmap and trim thresholds serves them from the heap, where freed
memory is reused. vLLM's CPU backend gets the same by preloading tcmalloc.

The setting is process-wide and harmless elsewhere; it is applied once, when
the first model is built, and only where glibc's ``mallopt`` exists.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools

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
