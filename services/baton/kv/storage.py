"""What the KV cache's bytes are: the compute dtype, or fp8 with a scale (``kv_cache.dtype``).

Design (after vLLM's ``--kv-cache-dtype fp8`` and its ``k_scale`` / ``v_scale``): keys and
values are stored divided by a per-tensor ``scale`` and saturated to the fp8 format's range,
and read back multiplied by it, in the compute dtype. Everything that writes the pool's
storage (a prefill chunk, a decode step, a cache that arrives, a tensor-parallel rank's
mirror) stores through ``KVStorage.store``; everything that reads it (attention, a gather for
PyramidInfer, a migration) loads through ``KVStorage.load``. A chain's tail stores the same
way before it ships (``store_layer``), so the wire carries the pool's bytes, and a decode pod
copies them into its blocks as they are.

The scale is one number for every layer, head, key and value, fixed by configuration
(1.0 without calibration, as vLLM's default): every token is stored the same way whenever it
is written, so a block's bytes never depend on what came after it (a scale computed from
the data of a later chunk would requantize the tokens before it), a prefix-cache hit and a
shipped cache mean what they meant when they were written, and every rank of a
tensor-parallel group stores its heads exactly as one process stores them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from baton.dtypes import KV_CACHE_DTYPES, dtype_name
from baton.kv.dense import LayerKV

FP8_DTYPES = frozenset({torch.float8_e4m3fn, torch.float8_e5m2})


@dataclass(frozen=True)
class KVStorage:
    """How a cache's keys and values are held: ``dtype``, and for fp8 the ``scale`` they
    are divided by when stored."""

    dtype: torch.dtype
    scale: float = 1.0

    def __post_init__(self) -> None:
        if not self.scale > 0:
            raise ValueError(f"a KV cache scale must be > 0, got {self.scale}")

    @property
    def quantized(self) -> bool:
        return self.dtype in FP8_DTYPES

    @property
    def name(self) -> str:
        """The dtype's name on the wire and in routing records (``baton.dtypes``)."""
        return dtype_name(self.dtype)

    def store(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` as stored. A tensor in the storage dtype already is taken as it is: it was
        stored with this scale (a shipped cache checked against it)."""
        if x.dtype == self.dtype:
            return x
        if not self.quantized:
            return x.to(self.dtype)
        limit = torch.finfo(self.dtype).max  # saturate: out of range, e4m3fn has only NaN
        scaled = x / self.scale if self.scale != 1.0 else x
        return scaled.clamp(-limit, limit).to(self.dtype)

    def load(self, x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Stored ``x`` back in the compute ``dtype``."""
        if not self.quantized:
            return x
        x = x.to(dtype)
        return x * self.scale if self.scale != 1.0 else x

    def store_layer(self, layer: LayerKV) -> LayerKV:
        """One layer of a dense cache, its keys and values as stored (to ship)."""
        if not self.quantized:
            return layer
        return LayerKV(self.store(layer.k), self.store(layer.v), layer.positions)


def kv_storage(cache_dtype: str, scale: float, compute_dtype: torch.dtype) -> KVStorage:
    """The storage ``kv_cache.dtype`` and ``kv_cache.scale`` name for a model computing in
    ``compute_dtype`` (``auto``: the compute dtype itself, unscaled)."""
    if cache_dtype not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache dtype {cache_dtype!r} is not one of {tuple(KV_CACHE_DTYPES)}")
    dtype = KV_CACHE_DTYPES[cache_dtype]
    return KVStorage(compute_dtype) if dtype is None else KVStorage(dtype, scale)


def copy_rows(target: torch.Tensor, index: torch.Tensor, rows: torch.Tensor) -> None:
    """``target.index_copy_(0, index, rows)``; fp8 tensors as bytes (torch's CPU
    ``index_copy_`` takes no fp8, and a copy of bytes is the same copy)."""
    if target.dtype in FP8_DTYPES:
        target, rows = target.view(torch.uint8), rows.view(torch.uint8)
    target.index_copy_(0, index, rows)
