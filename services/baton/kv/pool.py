"""The paged KV pool: fixed-size blocks, one block table per (sequence, layer).

Design: K and V for all layers share one pool of blocks ([num_blocks, block_size, Hkv, D]
each); a block belongs to one (sequence, layer). Every stored token keeps its original
position (RoPE was applied with it; masks compare it). The pool is what admission control
counts. Its roles live in modules of their own, one part of ``KVPool`` each:

* ``baton.kv.tables``         blocks and block tables, accounting, ``reserve`` / ``free``
* ``baton.kv.prefix_blocks``  sharing full prompt blocks (the prefix cache)
* ``baton.kv.landing``        caches that arrive (``store``, ``land``): KV transfer's interface
* ``baton.kv.prefill_step``   a prefill chunk's metadata, built by the runner
* ``baton.kv.decode_step``    a decode step's metadata, built by the runner
* ``baton.kv.storage``        what the blocks' bytes are (the compute dtype, or fp8 and a scale)

and here, the storage and what reads, writes and prunes it directly. Data moves with
``index_select`` / ``index_copy_`` over the first dimension (blocks to read, token slots to
write): on a CPU that is far faster than advanced indexing (``cache[index]``), which decode
steps would otherwise pay on every layer.
"""

from __future__ import annotations

from typing import Protocol

import torch

from baton.host_memory import huge_page_zeros
from baton.host_to_device import to_device
from baton.kv.decode_step import DecodeSteps
from baton.kv.dense import LayerKV
from baton.kv.landing import Landings
from baton.kv.prefill_step import PrefillSteps
from baton.kv.prefix_blocks import PrefixBlocks
from baton.kv.storage import KVStorage, copy_rows
from baton.kv.tables import BlockTables, KVPoolExhausted

__all__ = ["KVPool", "KVPoolExhausted", "PagedSequenceKV"]


class KVPool(BlockTables, PrefixBlocks, Landings, PrefillSteps, DecodeSteps):
    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, block_size: int,
                 num_blocks: int, dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu", cache_prefixes: bool = False,
                 storage: KVStorage | None = None) -> None:
        """``dtype``: what the model computes in, and reads keys and values back in;
        ``storage``: what the blocks hold (default: ``dtype`` itself)."""
        self._init_tables(num_layers, block_size, num_blocks)
        self._init_storage((num_blocks, block_size, num_kv_heads, head_dim), dtype,
                           storage or KVStorage(dtype), device)
        self._init_prefixes(cache_prefixes)
        self._init_decode_steps()

    def _init_storage(self, shape: tuple[int, ...], dtype: torch.dtype, storage: KVStorage,
                      device: torch.device | str) -> None:
        self.compute_dtype = dtype
        self.storage = storage
        self.k_cache = self._zeros(shape, storage.dtype, device)
        self.v_cache = self._zeros(shape, storage.dtype, device)
        self.positions = torch.zeros(shape[:2], dtype=torch.int64, device=device)
        # Under tensor parallelism this rank's storage holds its KV heads alone, and the
        # other ranks' storage follows every write and move made here (``StorageMirror``).
        self.mirror: StorageMirror | None = None
        # A host cache's storage as bytes: received KV is copied into its blocks as it lies.
        self._k_bytes, self._v_bytes = (
            (memoryview(cache.view(-1).view(torch.uint8).numpy()) for cache in (self.k_cache, self.v_cache))
            if self.k_cache.device.type == "cpu" else (None, None))

    @staticmethod
    def _zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
        """The cache's storage: on a CPU in huge pages (decode reads its blocks at random)."""
        if torch.device(device).type == "cpu":
            return huge_page_zeros(shape, dtype)
        return torch.zeros(shape, dtype=dtype, device=device)

    def append(self, seq_id: str, layer: int, k: torch.Tensor, v: torch.Tensor,
               positions: torch.Tensor) -> None:
        """Store new tokens of one layer (k, v: [T, Hkv, D]); claims blocks if not reserved."""
        table = self._tables.get(seq_id, [None] * self.num_layers)[layer]
        count = k.shape[0]
        if table is None or len(table.blocks) < self.blocks_for(table.length + count):
            extra = [0] * self.num_layers
            extra[layer] = count
            self.reserve(seq_id, extra)
            table = self._tables[seq_id][layer]
        slots = self._slots(table, count)
        table.length += count
        self._write_at(to_device(slots, self.k_cache.device), k, v, positions)

    def gather(self, seq_id: str, layer: int) -> LayerKV:
        """One layer of one sequence as contiguous tensors (a copy; every KV head, under a
        mirror too)."""
        table = self._tables[seq_id][layer]
        k, v, positions = self.read_rows(to_device(table.blocks, self.k_cache.device),
                                         table.length, with_values=True)
        return LayerKV(k, v, positions)

    def keys(self, seq_id: str, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """One layer of one sequence's keys [n, Hkv, D] and their positions [n] (copies):
        ``gather`` without the values, for a reader that scores."""
        table = self._tables[seq_id][layer]
        k, _, positions = self.read_rows(to_device(table.blocks, self.k_cache.device),
                                         table.length, with_values=False)
        return k, positions

    def read_rows(self, blocks: torch.Tensor, length: int, with_values: bool):
        """(keys, values or None, positions) of the first ``length`` token rows of ``blocks``;
        under a mirror, every rank's heads."""
        if self.mirror is not None:
            return self.mirror.read(self, blocks, length, with_values)
        return self.own_rows(blocks, length, with_values)

    def own_rows(self, blocks: torch.Tensor, length: int, with_values: bool):
        """``read_rows`` of this rank's storage alone (keys and values in the compute dtype)."""
        load = self.storage.load
        return (load(self._rows(self.k_cache, blocks, length), self.compute_dtype),
                load(self._rows(self.v_cache, blocks, length), self.compute_dtype)
                if with_values else None,
                self._rows(self.positions, blocks, length))

    @staticmethod
    def _rows(cache: torch.Tensor, blocks: torch.Tensor, length: int) -> torch.Tensor:
        """The first ``length`` token rows of ``blocks`` of a ``[blocks, block_size, ...]``
        tensor, in order (a copy)."""
        return cache.index_select(0, blocks).view((-1,) + cache.shape[2:])[:length]

    def retain(self, seq_id: str, layer: int, keep: torch.Tensor) -> None:
        """Keep only the tokens at sorted indices ``keep`` of one layer; frees emptied blocks.

        The kept tokens move down in place, in order: those before the first dropped one
        stay where they are, so a pruned batch in the middle moves only what follows it."""
        assert not self.shares_cached_blocks(seq_id), "pruning a sequence that shares cached blocks"
        table = self._tables[seq_id][layer]
        keep = keep.to("cpu", torch.int64)
        count = keep.numel()
        unmoved = int((keep == torch.arange(count)).sum())  # sorted and distinct: a prefix
        if unmoved < count:
            slots = self._token_slots(table)
            self.move_tokens(to_device(slots[keep[unmoved:]], self.k_cache.device),
                             to_device(slots[unmoved:count], self.k_cache.device))
        surplus = table.blocks[self.blocks_for(count):]
        del table.blocks[self.blocks_for(count):]
        self._free.extend(reversed(surplus))
        table.length = count
        if surplus and self._batch is not None:  # its first blocks stay: the row is shorter
            self._batch.truncate(seq_id, layer, len(table.blocks))

    def move_tokens(self, source: torch.Tensor, target: torch.Tensor) -> None:
        """Copy the tokens at flat slots ``source`` to flat slots ``target`` (keys, values and
        positions)."""
        if self.mirror is not None:
            self.mirror.move(self, source, target)
        tokens = self.num_blocks * self.block_size
        for cache in (self.k_cache, self.v_cache, self.positions):
            flat = cache.view(tokens, *cache.shape[2:])
            copy_rows(flat, target, flat.index_select(0, source))

    def _write_at(self, index: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                  positions: torch.Tensor) -> None:
        """Write tokens to flat slots ``index``, one ``index_copy_`` per tensor. The tokens may
        come from another device or dtype (a cache from the wire or a chain arrives in host
        memory), stored as ``storage`` says. Under a mirror they have every KV head, and this
        rank keeps its own (every rank stores its heads alike)."""
        if self.mirror is not None:
            k, v = self.mirror.write(self, index, k, v, positions)
        device = self.k_cache.device
        tokens = self.num_blocks * self.block_size
        for cache, new in ((self.k_cache, k), (self.v_cache, v)):
            copy_rows(cache.view(tokens, *cache.shape[2:]), index, self.storage.store(new.to(device)))
        self.positions.view(tokens).index_copy_(0, index, positions.to(device, torch.int64))

    def view(self, seq_id: str) -> PagedSequenceKV:
        return PagedSequenceKV(self, seq_id)


class StorageMirror(Protocol):
    """The other ranks of a tensor-parallel group, told of every change a pool's storage takes
    outside a forward (``baton.parallel.leader``)."""

    def write(self, pool: KVPool, index: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
              positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Every rank writes its heads of k, v ([T, Hkv, D], all heads); returns this rank's."""

    def move(self, pool: KVPool, source: torch.Tensor, target: torch.Tensor) -> None: ...

    def read(self, pool: KVPool, blocks: torch.Tensor, length: int, with_values: bool
             ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
        """``KVPool.own_rows`` of every rank, their heads joined."""


class PagedSequenceKV:
    """``SequenceKV`` over one sequence in a ``KVPool``, a layer at a time: for callers
    outside the engines (a single prompt, a sample); the engine's runner prepares each
    chunk's slots instead (``KVPool.prefill_segment``)."""

    def __init__(self, pool: KVPool, seq_id: str) -> None:
        self.pool = pool
        self.seq_id = seq_id

    def extend(self, layer: int, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor):
        first = self.pool.length(self.seq_id, layer) == 0
        self.pool.append(self.seq_id, layer, k, v, positions)
        if first:  # nothing cached before: the new tokens are all there is (no gather)
            return k, v, positions
        stored = self.pool.gather(self.seq_id, layer)
        return stored.k, stored.v, stored.positions
