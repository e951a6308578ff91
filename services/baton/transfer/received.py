"""A pushed cache on its way into the pool: its keys and values copied once, from the
messages that carried them into the pool's blocks.

Why: gRPC hands the receiver every chunk of a push as a ``bytes`` object of its own (one copy
of its 64 KiB read slices, then a join: copies a receiver cannot avoid). Any further copy
(into a buffer per tensor, then from the buffer into the blocks) moves every byte again on
the decode pod. So a cache takes one of two ways into the blocks:

* landed (``baton.kv.landing``): the pool claims the cache's blocks while it arrives
  (``KVPool.land``) and the receiver writes each chunk into them at once (``RangeWriter``),
  while the chunk is still in the CPU's cache; only the positions travel on;
* kept (``ReceivedLayer``): each layer's keys and values stay the pieces of the messages they
  came in, alive until the pool copies them into the blocks it gives the cache
  (``KVPool.store``).

Pieces may split a token anywhere (a sender cuts its chunks by bytes, not by tokens): a
layer's keys are one byte stream, and the blocks' ranges take it as one (``copy_pieces``).
The positions are small (8 bytes a token against kilobytes of keys and values) and are made
whole at once, so that the receiver can check them before the cache exists.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from baton.kv.landing import LayerStore


@dataclass(frozen=True)
class ReceivedLayer:
    """One layer of a received cache (the same reading interface as ``LayerKV``): positions
    [S] as a tensor, keys and values [S, Hkv, D] as the pieces of their bytes in order, in the
    receiver's byte order. ``k`` and ``v`` make whole tensors of them (a copy) for a reader
    that needs tensors; the pool copies the pieces straight into its blocks instead."""

    positions: torch.Tensor
    k_pieces: tuple[memoryview, ...]
    v_pieces: tuple[memoryview, ...]
    dtype: torch.dtype
    num_kv_heads: int
    head_dim: int

    @property
    def num_tokens(self) -> int:
        return self.positions.shape[0]

    @functools.cached_property
    def k(self) -> torch.Tensor:
        return self._tensor(self.k_pieces)

    @functools.cached_property
    def v(self) -> torch.Tensor:
        return self._tensor(self.v_pieces)

    def _tensor(self, pieces: Sequence[memoryview]) -> torch.Tensor:
        return joined(pieces).view(self.dtype).view(self.num_tokens, self.num_kv_heads,
                                                    self.head_dim)

    def store_into(self, pool: LayerStore, seq_id: str, layer: int) -> None:
        """Into the pool's fresh blocks for this layer: the pieces straight into the blocks'
        bytes where they are the same dtype and shape (each byte copied once), else as
        tensors."""
        if not pool.takes_bytes(self.dtype, self.num_kv_heads, self.head_dim):
            pool.append(seq_id, layer, self.k, self.v, self.positions)
            return
        k_ranges, v_ranges = pool.layer_bytes(seq_id, layer, self.num_tokens)
        copy_pieces(self.k_pieces, k_ranges)
        copy_pieces(self.v_pieces, v_ranges)
        pool.write_positions(seq_id, layer, self.positions)


class RangeWriter:
    """Writes a byte stream, piece by piece as it comes, into byte ranges in order."""

    def __init__(self, targets: Sequence[memoryview]) -> None:
        self._targets = targets
        self._index = 0  # the range the next byte goes to, and where in it
        self._offset = 0

    @property
    def done(self) -> bool:
        return self._index == len(self._targets)

    def write(self, source: memoryview) -> None:
        for view in self.next_views(len(source)):
            view[:] = source[:len(view)]
            source = source[len(view):]

    def next_views(self, num_bytes: int) -> list[memoryview]:
        """The next ``num_bytes`` of the ranges, as writable views (now counted as written)."""
        views = []
        while num_bytes:
            target = self._targets[self._index]
            count = min(len(target) - self._offset, num_bytes)
            views.append(target[self._offset:self._offset + count])
            num_bytes -= count
            self._offset += count
            if self._offset == len(target):
                self._index, self._offset = self._index + 1, 0
        return views


def joined(pieces: Sequence[memoryview], pin_memory: bool = False) -> torch.Tensor:
    """The bytes of ``pieces`` as one fresh uint8 tensor (a copy; in pinned memory, for a copy
    to a GPU, with ``pin_memory``)."""
    raw = torch.empty(sum(len(piece) for piece in pieces), dtype=torch.uint8, pin_memory=pin_memory)
    copy_pieces(pieces, [memoryview(raw.numpy())])
    return raw


def copy_pieces(sources: Sequence[memoryview], targets: Sequence[memoryview]) -> None:
    """Copy the byte stream ``sources`` into the byte ranges ``targets``, in order; both
    hold the same number of bytes, cut anywhere."""
    writer = RangeWriter(targets)
    for source in sources:
        writer.write(source)
    assert writer.done, "sources and targets differ in length"
