"""Decode attention that reads a paged KV cache where it lies on CUDA, through torch's
FlexAttention (``torch.nn.attention.flex_attention``, compiled to Triton).

Without it a decode batch gathers every sequence's blocks into a padded tensor and attends
that: the cache's bytes are read twice and written once more. Here the pool's storage is one
long key sequence ([1, Hkv, blocks * block_size, D], a view) and each decode row is a batch
entry whose block mask lists its own blocks, so the kernel visits those blocks alone, in
place. A row's full blocks need no mask; its last, partly filled block is the only "partial"
block, masked by how many of its slots the row holds (``tail``). Per-layer lengths
(PyramidInfer's pruned layers) are simply other lengths and tables.

The compiled kernel's batch is static (FlexAttention's decoding kernel splits its work by
batch and heads), so rows are padded to a power of two and each bucket compiles once; rows
past the real batch list no blocks and are dropped. The index buffers are per bucket and
reused, so a captured CUDA graph reads each step's tables from the same addresses.

Applies where the decoding kernel does: CUDA, no sliding window or soft-capping (the caller
checks those), a power-of-two query group per KV head, a head size of 16 or more, a cache
in the compute dtype; and only in a step replayed from a CUDA graph (the compiled call costs
host time on every layer that an eager step pays in full). Where it pays: over 16-token
blocks its kernel walks a row's blocks one small tile at a time, so it beats gathering only
where the gather's copy is large, from ``MIN_ROWS`` rows up (docs/benchmarks/decode-gpu.md).
``BATON_FLEX_DECODE``: ``auto`` (that rule, the default), ``1`` (every replayed step), ``0``
(never).
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass

import torch

# Every power of two up to this many rows compiles its own kernel, for each pool in the
# process (a server has one; tests and benchmarks make several); torch's default limit on
# recompilations of one function (8) would send the rest to the unfused fallback.
MAX_ROWS = 1024
_RECOMPILE_LIMIT = 256


# From this many rows a replayed step reads in place (the gathered read wins below).
MIN_ROWS = 64


def setting() -> str:
    return os.environ.get("BATON_FLEX_DECODE", "auto")


def enabled() -> bool:
    return setting() != "0"


def wanted(rows: int) -> bool:
    """Should a replayed decode step of ``rows`` rows read in place (``fits`` permitting)?"""
    return setting() == "1" or (setting() == "auto" and rows >= MIN_ROWS)


def fits(dtype: torch.dtype, device: torch.device, head_dim: int, num_heads: int,
         num_kv_heads: int) -> bool:
    """Can FlexAttention's decoding kernel read a paged cache of this model shape in place?"""
    group = num_heads // num_kv_heads
    return (torch.device(device).type == "cuda" and enabled() and _available()
            and dtype in (torch.float32, torch.bfloat16, torch.float16)
            and num_heads % num_kv_heads == 0 and group & (group - 1) == 0
            and head_dim >= 16 and head_dim & (head_dim - 1) == 0)


@functools.cache
def _available() -> bool:
    try:
        from torch.nn.attention.flex_attention import BlockMask, flex_attention  # noqa: F401
    except ImportError:
        return False
    return True


def bucket(rows: int) -> int:
    return 1 << max(rows - 1, 0).bit_length()


@dataclass
class _Bucket:
    """One row bucket's index buffers, kept across steps (a graph replays from them)."""

    query: torch.Tensor  # [R, H, 1, D]
    full_count: torch.Tensor  # [R, 1, 1] int32: full blocks of each row
    full_blocks: torch.Tensor  # [R, 1, 1, num_blocks] int32: a row's table in its first columns
    tail_count: torch.Tensor  # [R, 1, 1] int32: 1 where the row's last block is partly filled
    tail_block: torch.Tensor  # [R, 1, 1, num_blocks] int32: that block in column 0
    tail: torch.Tensor  # [R] int32: slots the row holds in that block
    mask: object = None  # its BlockMask, made once: the buffers above are its tensors


class PagedFlexDecode:
    """Decode attention over one pool's storage (``num_blocks`` blocks of ``block_size``)."""

    def __init__(self, num_blocks: int, block_size: int, device: torch.device) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.device = device
        self._buckets: dict[tuple[int, int, int, torch.dtype], _Bucket] = {}

    def __call__(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 blocks: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        """q: [n, H, D]; k_cache, v_cache: [num_blocks, block_size, Hkv, D]; blocks: [n, W]
        block ids (columns past a row's blocks are ignored); lengths: [n] tokens each row
        holds, the new one counted. Returns [n, H, D]."""
        count, num_heads, head_dim = q.shape
        rows = bucket(count)
        if rows > MAX_ROWS:
            raise ValueError(f"a decode batch of {count} rows is more than FlexAttention's "
                             f"{MAX_ROWS} here")
        state = self._bucket(rows, num_heads, head_dim, q.dtype)
        size = self.block_size
        width = blocks.shape[1]
        lengths = lengths.to(torch.int32)
        full = torch.div(lengths, size, rounding_mode="floor")
        tail = lengths - full * size
        state.query[:count, :, 0].copy_(q)
        state.full_count[:count, 0, 0].copy_(full)
        state.full_blocks[:count, 0, 0, :width].copy_(blocks)
        state.tail_count[:count, 0, 0].copy_((tail > 0).to(torch.int32))
        last = full.clamp(max=width - 1).to(torch.int64)[:, None]
        state.tail_block[:count, 0, 0, :1].copy_(blocks.gather(1, last))
        state.tail[:count].copy_(tail)
        if count < rows:  # padded rows list no blocks
            state.full_count[count:].zero_()
            state.tail_count[count:].zero_()
        return _compiled()(state.query, k_cache, v_cache, state.mask)[:count, :, 0]

    def _bucket(self, rows: int, num_heads: int, head_dim: int, dtype: torch.dtype) -> _Bucket:
        key = (rows, num_heads, head_dim, dtype)
        state = self._buckets.get(key)
        if state is None:
            state = self._buckets[key] = self._allocate(rows, num_heads, head_dim, dtype)
        return state

    def _allocate(self, rows: int, num_heads: int, head_dim: int, dtype: torch.dtype) -> _Bucket:
        from torch.nn.attention.flex_attention import BlockMask

        def zeros(*shape, kind=torch.int32):
            return torch.zeros(shape, dtype=kind, device=self.device)

        state = _Bucket(query=zeros(rows, num_heads, 1, head_dim, kind=dtype),
                        full_count=zeros(rows, 1, 1), full_blocks=zeros(rows, 1, 1, self.num_blocks),
                        tail_count=zeros(rows, 1, 1), tail_block=zeros(rows, 1, 1, self.num_blocks),
                        tail=zeros(rows))
        size, tail = self.block_size, state.tail

        def in_tail(batch, head, query, key):  # only the partial block is masked
            return (key % size) < tail[batch]

        state.mask = BlockMask.from_kv_blocks(
            state.tail_count, state.tail_block, state.full_count, state.full_blocks,
            BLOCK_SIZE=(128, size), mask_mod=in_tail, seq_lengths=(1, self.num_blocks * size),
            compute_q_blocks=False)
        return state


_READERS: dict[tuple[int, tuple[int, ...], str], PagedFlexDecode] = {}


def reader_for(k_cache: torch.Tensor) -> PagedFlexDecode:
    """The reader of the pool whose key storage is ``k_cache`` [num_blocks, block_size, Hkv, D]
    (one per pool: its buffers are sized by the pool's blocks)."""
    key = (k_cache.data_ptr(), tuple(k_cache.shape), str(k_cache.device))
    reader = _READERS.get(key)
    if reader is None:
        reader = _READERS[key] = PagedFlexDecode(k_cache.shape[0], k_cache.shape[1], k_cache.device)
    return reader


def _attend(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
            mask) -> torch.Tensor:
    """FlexAttention of query [R, H, 1, D] over the pool's storage seen as one key sequence."""
    from torch.nn.attention.flex_attention import flex_attention

    blocks, size, num_kv_heads, head_dim = k_cache.shape
    keys = k_cache.view(1, blocks * size, num_kv_heads, head_dim).transpose(1, 2)
    values = v_cache.view(1, blocks * size, num_kv_heads, head_dim).transpose(1, 2)
    return flex_attention(query, keys, values, block_mask=mask,
                          enable_gqa=query.shape[1] != num_kv_heads)


_COMPILED = None


def _compiled():
    """``_attend`` compiled once per process; each pool size and row bucket is a recompilation
    (the block mask's lengths are constants, and the decoding kernel wants a static batch)."""
    global _COMPILED
    if _COMPILED is None:
        import torch._dynamo

        config = torch._dynamo.config
        config.recompile_limit = max(config.recompile_limit, _RECOMPILE_LIMIT)
        _COMPILED = torch.compile(_attend, fullgraph=True, dynamic=False)
    return _COMPILED
