"""The pool's side of caches that arrive from elsewhere (a chain's push, a host copy): the one
narrow interface KV transfer (``baton.transfer``) reaches the pool through.

Two ways in, all layers or none:

* stored (``KVPool.store``): every layer of the cache puts itself into the blocks the pool
  reserved for it (``StorableLayer.store_into``), through ``LayerStore``: a cache of the
  blocks' dtype and shape copies its bytes straight into the blocks' byte ranges
  (``layer_bytes``, then ``write_positions``), anything else is appended as tensors;
* landed: the pool claims the blocks while the cache is still arriving (``land``), the
  receiver writes the bytes into them as they come, and ``store`` of the ``LandedLayer``-s
  then only hands the blocks to the sequence and writes the positions (``settle``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from baton.host_to_device import to_device


class LayerStore(Protocol):
    """What a layer storing itself may ask of the pool (``KVPool`` is one)."""

    def takes_bytes(self, dtype: torch.dtype, num_kv_heads: int, head_dim: int) -> bool: ...

    def layer_bytes(self, seq_id: str, layer: int, num_tokens: int
                    ) -> tuple[list[memoryview], list[memoryview]]: ...

    def write_positions(self, seq_id: str, layer: int, positions: torch.Tensor) -> None: ...

    def append(self, seq_id: str, layer: int, k: torch.Tensor, v: torch.Tensor,
               positions: torch.Tensor) -> None: ...


class StorableLayer(Protocol):
    """One layer of a cache that arrived (``LayerKV``, a received or device-bound layer)."""

    @property
    def num_tokens(self) -> int: ...

    def store_into(self, pool: LayerStore, seq_id: str, layer: int) -> None: ...


@dataclass(frozen=True, eq=False)
class Landing:
    """Blocks a pool holds for a cache still arriving (``KVPool.land``): per layer, the byte
    ranges of its keys and of its values. The landing is its own key among the pool's
    sequences (by identity: no request id can be it) until the cache is stored."""

    targets: list[tuple[list[memoryview], list[memoryview]]]


@dataclass(frozen=True)
class LandedLayer:
    """One layer of a received cache whose keys and values went straight into the pool's
    blocks as they arrived (``landing``): only its positions [S] travel on, to be written
    with them when the pool ``store``-s it."""

    positions: torch.Tensor
    landing: Landing

    @property
    def num_tokens(self) -> int:
        return self.positions.shape[0]


class Landings:
    """``KVPool``'s part for caches that arrive: ``store``, ``land`` and the byte ranges of
    its host storage. Reads the pool's tables, its storage and its byte views."""

    def store(self, seq_id: str, layers: list[StorableLayer] | list[LandedLayer]) -> None:
        """Put a whole (possibly pyramid-shaped) cache into the pool, all layers or none."""
        if len(layers) != self.num_layers:
            raise ValueError(f"cache has {len(layers)} layers, the pool {self.num_layers}")
        if all(isinstance(layer, LandedLayer) for layer in layers):
            self._settle(seq_id, layers)
            return
        if seq_id in self._tables:
            raise ValueError(f"sequence {seq_id!r} already holds KV in this pool")
        self.reserve(seq_id, [layer.num_tokens for layer in layers])
        for index, layer in enumerate(layers):
            layer.store_into(self, seq_id, index)

    def takes_bytes(self, dtype: torch.dtype, num_kv_heads: int, head_dim: int) -> bool:
        """Whether keys and values of this dtype and shape are the blocks' bytes as they are:
        a host pool of the same dtype and shape, whose storage no other rank mirrors."""
        return (self._k_bytes is not None and self.mirror is None and dtype == self.k_cache.dtype
                and (num_kv_heads, head_dim) == tuple(self.k_cache.shape[2:]))

    def land(self, layer_num_tokens: list[int]) -> Landing:
        """Claim blocks for a cache still arriving (all layers or none: KVPoolExhausted),
        and say where its keys and values go (a host pool only: ``takes_bytes``). Once they
        are in, ``store`` gives them to a sequence with their positions (``LandedLayer``);
        until then the landing holds the blocks, empty, and ``free(landing)`` returns them."""
        assert self._k_bytes is not None, "only a host pool takes bytes"
        landing = Landing([])
        self.reserve(landing, list(layer_num_tokens))
        landing.targets.extend(self.layer_bytes(landing, layer, count)
                               for layer, count in enumerate(layer_num_tokens))
        return landing

    def layer_bytes(self, seq_id: str, layer: int, num_tokens: int
                    ) -> tuple[list[memoryview], list[memoryview]]:
        """Writable byte ranges of the keys and of the values of a layer's first
        ``num_tokens`` token rows, in its blocks' order (a host pool: ``takes_bytes``)."""
        blocks = self._tables[seq_id][layer].blocks
        return (self._block_bytes(self._k_bytes, blocks, num_tokens),
                self._block_bytes(self._v_bytes, blocks, num_tokens))

    def write_positions(self, seq_id: str, layer: int, positions: torch.Tensor) -> None:
        """The positions of a layer's (empty) blocks' tokens, whose keys and values are in:
        from now on the layer holds them."""
        table = self._tables[seq_id][layer]
        count = positions.shape[0]
        index = to_device(self._slots(table, count), self.positions.device)
        self.positions.view(-1).index_copy_(0, index, positions.to(torch.int64))
        table.length = count

    def _settle(self, seq_id: str, layers: list[LandedLayer]) -> None:
        """A landed cache's bytes are all in its blocks: they become ``seq_id``'s, with the
        positions written and the tokens counted."""
        landing = layers[0].landing
        if landing not in self._tables or any(layer.landing is not landing for layer in layers):
            raise ValueError(f"the cache for sequence {seq_id!r} did not land in this pool")
        if seq_id in self._tables:
            raise ValueError(f"sequence {seq_id!r} already holds KV in this pool")
        tables = self._tables[seq_id] = self._tables.pop(landing)
        for index, (table, layer) in enumerate(zip(tables, layers)):
            if len(table.blocks) != self.blocks_for(layer.num_tokens):
                raise ValueError(f"sequence {seq_id!r} landed {len(table.blocks)} blocks for "
                                 f"{layer.num_tokens} tokens")
            self.write_positions(seq_id, index, layer.positions)

    def _block_bytes(self, cache_bytes: memoryview, blocks: list[int], num_tokens: int
                     ) -> list[memoryview]:
        """Writable byte ranges of the first ``num_tokens`` token rows of ``blocks`` of a host
        cache (``cache_bytes``: its storage), in order; a run of consecutive blocks is one range."""
        if not blocks:
            return []
        block_bytes = len(cache_bytes) // self.num_blocks
        token_bytes = block_bytes // self.block_size
        ranges: list[list[int]] = []  # [first byte, end]
        for block in blocks:
            if ranges and ranges[-1][1] == block * block_bytes:
                ranges[-1][1] += block_bytes
            else:
                ranges.append([block * block_bytes, (block + 1) * block_bytes])
        surplus = (len(blocks) * self.block_size - num_tokens) * token_bytes
        ranges[-1][1] -= surplus  # the last block's rows past the tokens stay as they are
        return [cache_bytes[start:end] for start, end in ranges]
