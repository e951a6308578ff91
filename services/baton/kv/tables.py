"""Blocks and block tables: which blocks are free, which (sequence, layer) holds which, and
how many tokens each layer holds.

A block belongs to one (sequence, layer). Layers hold different numbers of tokens once
PyramidInfer has pruned them, so each (sequence, layer) has its own table and length.
``blocks_needed`` and ``reserve`` let an engine check and claim room for a whole step up
front (all layers or none), so a forward never runs out half way; running out raises
``KVPoolExhausted`` and never crashes. Cached prefix blocks nobody holds count as free:
taking a block evicts one (least recently used first) when the free list runs dry.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from baton.errors import ResourceExhausted
from baton.host_to_device import to_device


class KVPoolExhausted(ResourceExhausted, RuntimeError):
    """The pool has too few free blocks for a request (names both numbers)."""

    def __init__(self, blocks_needed: int, blocks_free: int) -> None:
        super().__init__(f"KV pool exhausted: need {blocks_needed} blocks, {blocks_free} free")
        self.blocks_needed = blocks_needed
        self.blocks_free = blocks_free


@dataclass
class LayerTable:
    blocks: list[int] = field(default_factory=list)
    length: int = 0


class BlockTables:
    """``KVPool``'s allocator: its free list (``_free``), tables (``_tables``) and counts.
    ``free`` also drops a sequence's part in the prefix cache and the decode batch's tables."""

    def _init_tables(self, num_layers: int, block_size: int, num_blocks: int) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"KV pool needs num_blocks >= 1 and block_size >= 1, "
                             f"got {num_blocks} and {block_size}")
        self.num_layers = num_layers
        self.block_size = block_size
        self.num_blocks = num_blocks
        self._free: list[int] = list(range(num_blocks - 1, -1, -1))  # pop() hands out low ids first
        self._tables: dict[str, list[LayerTable]] = {}
        self._scratch: int | None = None  # see scratch_block

    # --- accounting ------------------------------------------------------------------------

    @property
    def bytes_per_block(self) -> int:
        return 2 * self.k_cache[0].numel() * self.k_cache.element_size()

    @property
    def num_free_blocks(self) -> int:
        """Blocks a sequence can claim: the free ones and the cached ones nobody holds."""
        evictable = self.prefix_cache.num_evictable_pool_blocks if self.prefix_cache else 0
        return len(self._free) + evictable

    @property
    def num_used_blocks(self) -> int:
        """Blocks sequences hold (cached blocks nobody holds are not counted)."""
        return self.num_blocks - self.num_free_blocks

    @property
    def used_bytes(self) -> int:
        return self.num_used_blocks * self.bytes_per_block

    def blocks_for(self, num_tokens: int) -> int:
        return math.ceil(num_tokens / self.block_size)

    def blocks_needed(self, seq_id: str, new_tokens_per_layer: list[int] | int) -> int:
        """Free blocks that storing these new tokens would take (0 for a sequence that has room)."""
        if isinstance(new_tokens_per_layer, int):
            new_tokens_per_layer = [new_tokens_per_layer] * self.num_layers
        tables = self._tables.get(seq_id)
        needed = 0
        for layer, extra in enumerate(new_tokens_per_layer):
            table = tables[layer] if tables else LayerTable()
            needed += max(0, self.blocks_for(table.length + extra) - len(table.blocks))
        return needed

    def can_fit(self, seq_id: str, new_tokens_per_layer: list[int] | int) -> bool:
        return self.blocks_needed(seq_id, new_tokens_per_layer) <= self.num_free_blocks

    # --- sequences -------------------------------------------------------------------------

    def has(self, seq_id: str) -> bool:
        return seq_id in self._tables

    def sequence_ids(self) -> list[str]:
        return list(self._tables)

    def lengths(self, seq_id: str) -> list[int]:
        return [table.length for table in self._tables[seq_id]]

    def length(self, seq_id: str, layer: int) -> int:
        """Tokens one layer of a sequence holds (0 for a sequence the pool does not know)."""
        tables = self._tables.get(seq_id)
        return tables[layer].length if tables else 0

    def blocks_of(self, seq_id: str) -> int:
        return sum(len(table.blocks) for table in self._tables.get(seq_id, []))

    def reserve(self, seq_id: str, new_tokens_per_layer: list[int] | int) -> None:
        """Claim blocks for new tokens in every layer, all or none (raises KVPoolExhausted)."""
        tables = self._tables.get(seq_id)
        if isinstance(new_tokens_per_layer, int) and tables is not None:
            # A decode step's common case, checked cheaply: every layer has room already.
            capacity = self.block_size
            if all(t.length + new_tokens_per_layer <= len(t.blocks) * capacity for t in tables):
                return
        if isinstance(new_tokens_per_layer, int):
            new_tokens_per_layer = [new_tokens_per_layer] * self.num_layers
        needed = self.blocks_needed(seq_id, new_tokens_per_layer)
        if needed > self.num_free_blocks:
            raise KVPoolExhausted(needed, self.num_free_blocks)
        tables = self._tables.setdefault(seq_id, [LayerTable() for _ in range(self.num_layers)])
        for table, extra in zip(tables, new_tokens_per_layer):
            while len(table.blocks) < self.blocks_for(table.length + extra):
                table.blocks.append(self._take_block())

    def _take_block(self) -> int:
        if not self._free:  # callers checked num_free_blocks: a cached block nobody holds is left
            self._free.extend(reversed(self.prefix_cache.evict()))
        return self._free.pop()

    def free(self, seq_id: str) -> int:
        """Return a sequence's blocks to the pool (its cached ones stay cached, one reference
        fewer); returns how many blocks it held."""
        tables = self._tables.pop(seq_id, [])
        prefix = self._prefixes.pop(seq_id, None)
        self._batch = None
        count = 0
        for table in tables:
            count += len(table.blocks)
            if prefix and prefix.held:
                self._free.extend(b for b in reversed(table.blocks) if not self.prefix_cache.owns(b))
            else:
                self._free.extend(reversed(table.blocks))
        if prefix:
            self.prefix_cache.release(prefix.held)
        return count

    def scratch_block(self) -> int:
        """A block no sequence holds, set aside for good on first call: a padded decode batch
        (a CUDA graph's rows past the real batch) writes its dummy tokens there. Raises
        ``KVPoolExhausted`` when no block is free."""
        if self._scratch is None:
            if self.num_free_blocks < 1:
                raise KVPoolExhausted(1, 0)
            self._scratch = self._take_block()
        return self._scratch

    # --- slots: block * block_size + offset ------------------------------------------------

    def _token_slots(self, table: LayerTable) -> torch.Tensor:
        """Flat slot numbers of a table's tokens, in order (a host tensor)."""
        blocks = torch.tensor(table.blocks, dtype=torch.int64)
        return (blocks[:, None] * self.block_size + torch.arange(self.block_size)).view(-1)[:table.length]

    def _slots(self, table: LayerTable, count: int) -> torch.Tensor:
        """Flat slot numbers of a table's next ``count`` tokens, as a host tensor: made from the
        blocks they fall in, so that a prompt's write costs a few tensor ops per layer rather
        than Python work per token."""
        size = self.block_size
        first, end = table.length // size, self.blocks_for(table.length + count)
        blocks = to_device(table.blocks[first:end], "cpu")
        slots = (blocks[:, None] * size + torch.arange(size)).view(-1)
        start = table.length - first * size
        return slots[start:start + count]
