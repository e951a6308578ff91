"""A prefill chunk's metadata: what the runner builds and the model consumes.

Like a decode step (``baton.kv.decode_step``), a chunk of a prompt gets its room claimed and
its slots computed before the forward (``PrefillSteps.prefill_segment``): the model writes
each layer's new keys and values through the ``PrefillSegment`` and reads the sequence's
whole layer back from it, and never calls the pool.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from baton.host_to_device import to_device
from baton.kv.storage import KVStorage, copy_rows


@dataclass
class PrefillSegment:
    """One chunk of T new tokens of one sequence, every layer (a ``SequenceKV``).
    slots[l]: [T] flat slots of layer l's new tokens; blocks[l]: the layer's blocks, in
    order, holding lengths[l] tokens once the chunk is in."""

    slots: list[torch.Tensor]
    blocks: list[torch.Tensor]
    lengths: list[int]
    k_cache: torch.Tensor  # [num_blocks, block_size, Hkv, D], the pool's storage
    v_cache: torch.Tensor
    positions: torch.Tensor  # [num_blocks, block_size]
    storage: KVStorage | None = None  # what the caches hold (None: the compute dtype)

    def extend(self, layer: int, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor):
        """Store one layer's new tokens (k, v: [T, Hkv, D]; positions [T]); returns the layer's
        keys, values and positions so far (the new ones alone when nothing came before: as
        computed, like vLLM's prefill attention, even when the caches hold fp8), in k's dtype."""
        index = self.slots[layer]
        device = self.k_cache.device
        storage = self.storage
        for cache, new in ((self.k_cache, k), (self.v_cache, v)):
            new = new.to(device)
            new = storage.store(new) if storage is not None else new.to(cache.dtype)
            copy_rows(cache.view(-1, *cache.shape[2:]), index, new)
        self.positions.view(-1).index_copy_(0, index, positions.to(device, torch.int64))
        if self.lengths[layer] == k.shape[0]:  # nothing before: the new tokens are all there is
            return k, v, positions
        blocks, length = self.blocks[layer], self.lengths[layer]
        k_all, v_all, positions_all = (
            cache.index_select(0, blocks).view((-1,) + cache.shape[2:])[:length]
            for cache in (self.k_cache, self.v_cache, self.positions))
        if storage is not None:
            k_all, v_all = storage.load(k_all, k.dtype), storage.load(v_all, k.dtype)
        return k_all, v_all, positions_all


class PrefillSteps:
    """``KVPool``'s part that builds prefill chunks' metadata (reads its tables and storage)."""

    def prefill_segment(self, seq_id: str, num_tokens: int) -> PrefillSegment:
        """Claim room for ``num_tokens`` new tokens of a sequence in every layer (all or none:
        KVPoolExhausted) and return where they go; lengths count them from here on."""
        self.reserve(seq_id, num_tokens)
        device = self.k_cache.device
        slots, blocks, lengths = [], [], []
        for table in self._tables[seq_id]:
            slots.append(to_device(self._slots(table, num_tokens), device))
            table.length += num_tokens
            blocks.append(to_device(table.blocks, device))
            lengths.append(table.length)
        return PrefillSegment(slots, blocks, lengths, self.k_cache, self.v_cache, self.positions,
                              self.storage)
