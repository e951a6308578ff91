"""Receiving one pushed cache chunk by chunk and checking it before it exists for the caller
(the payload's layout and checks: ``baton.transfer.codec``)."""

from __future__ import annotations

import itertools
import sys
from typing import Self

import torch

from baton.dtypes import DTYPES
from baton.kv.dense import LayerKV
from baton.kv.landing import LandedLayer, Landing
from baton.transfer.codec import (
    LAYER_MAJOR,
    POSITION_BYTES,
    POSITION_DTYPE,
    Checksum,
    KVDataLoss,
    KVHeader,
    KVMalformed,
    KVSpec,
    check_header,
)
from baton.transfer.received import RangeWriter, ReceivedLayer, joined


class KVAssembler:
    """Receives one pushed cache chunk by chunk; ``finish()`` returns it once it checks out.

    Use as a context manager so that a stream that fails half way lets go of what arrived::

        with KVAssembler(header, spec) as assembler:
            for chunk in chunks:
                assembler.add(chunk)
            layers = assembler.finish()

    Nothing is copied as chunks arrive: each tensor of the payload collects the views of the
    chunks' bytes that fall in it (``baton.transfer.received``), and the pool copies them into its
    blocks. Bytes read over NIXL land in a buffer of their own (``next_views``), viewed the
    same way. Once the pool has blocks for the cache (``land``), keys and values go straight
    into them instead, while the chunk is still in cache, and NIXL reads into them.
    """

    def __init__(self, header: KVHeader, spec: KVSpec) -> None:
        check_header(header, spec)
        self.header = header
        self.spec = spec
        self._init_segments()

    def _init_segments(self) -> None:
        # One segment per tensor, in the payload's order (each layer's positions, K and V;
        # or every layer's positions together, then each layer's K and V).
        header = self.header
        tensor_bytes = header.num_kv_heads * header.head_dim * header.element_bytes
        if header.layout == LAYER_MAJOR:
            sizes = [size for num_tokens in header.layer_num_tokens for size in
                     (num_tokens * POSITION_BYTES, num_tokens * tensor_bytes, num_tokens * tensor_bytes)]
        else:
            sizes = [sum(header.layer_num_tokens) * POSITION_BYTES]
            for num_tokens in header.layer_num_tokens:
                sizes += [num_tokens * tensor_bytes] * 2
        self._sizes = sizes
        self._pieces: list[list[memoryview]] | None = [[] for _ in sizes]
        self._writers: list[RangeWriter | None] = [None] * len(sizes)  # once landed: K and V
        self.landing: Landing | None = None
        self._segment = 0  # the segment the next byte belongs to, and where in it
        self._offset = 0
        self._bytes_placed = 0
        self.bytes_received = 0
        self._checksum = Checksum(header.checksum_algorithm)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.discard()

    def add(self, chunk: bytes | memoryview) -> None:
        """The next chunk of the payload (kept, not copied: it must not change afterwards)."""
        view = memoryview(chunk)
        self._claim(len(view))
        self._checksum.update(view)
        self._place(view)
        self.bytes_received += len(view)

    def next_views(self, num_bytes: int) -> list[memoryview]:
        """Writable views of the payload's next ``num_bytes``, in buffers of their own, one per
        tensor they fall in (for a read straight into them: ``baton.transfer.nixl``); they count as
        received once ``filled``. A buffer is at most a layer's keys (a few MiB), which malloc
        serves from memory the process has: fresh pages cost more to fault in than the read."""
        self._claim(num_bytes)
        views = []
        while num_bytes:
            count = min(self._sizes[self._segment] - self._offset, num_bytes)
            writer = self._writers[self._segment]
            if writer is not None:
                views += writer.next_views(count)
            else:
                views.append(memoryview(torch.empty(count, dtype=torch.uint8).numpy()))
                self._pieces[self._segment].append(views[-1])
            self._advance(count)
            num_bytes -= count
        return views

    def land(self, landing: Landing) -> None:
        """From now on, write each layer's keys and values straight into the pool's blocks
        (``KVPool.land``), those that arrived already first; ``finish`` then returns
        ``LandedLayer``-s."""
        if self._pieces is None or self.landing is not None:
            raise RuntimeError("this KV assembler is finished, discarded or landed")
        assert self.header.byte_order == sys.byteorder, "a cache in another byte order is swapped"
        assert len(landing.targets) == self.header.num_layers
        for layer, layer_targets in enumerate(landing.targets):
            first = 3 * layer + 1 if self.header.layout == LAYER_MAJOR else 2 * layer + 1
            for segment, ranges in zip((first, first + 1), layer_targets):
                assert sum(len(view) for view in ranges) == self._sizes[segment]
                writer = RangeWriter(ranges)
                for piece in self._pieces[segment]:
                    writer.write(piece)
                self._pieces[segment] = []
                self._writers[segment] = writer
        self.landing = landing

    def filled(self, views: list[memoryview]) -> None:
        """``next_views`` hold their bytes now."""
        for view in views:
            self._checksum.update(view)
            self.bytes_received += len(view)

    def finish(self, checksum: int | None) -> list[LayerKV | ReceivedLayer] | list[LandedLayer]:
        """The received cache, after checking size, the sender's ``checksum`` (None: none
        arrived) and the positions."""
        if self._pieces is None:
            raise RuntimeError("this KV assembler is finished or discarded")
        if self.bytes_received != self.header.total_bytes:
            raise KVDataLoss(f"KV stream for {self.header.request_id!r} ended after "
                             f"{self.bytes_received} of {self.header.total_bytes} bytes")
        if checksum is None:
            raise KVDataLoss(f"KV stream for {self.header.request_id!r} ended without its checksum")
        if self._checksum.value != checksum:
            raise KVDataLoss(f"KV stream for {self.header.request_id!r} has checksum "
                             f"{self._checksum.value:#x}, its sender says {checksum:#x}")
        layers = self._unpack(self._pieces)
        self._check_positions(layers)
        self.discard()  # the layers keep their pieces alive; the assembler lets go of them
        return layers

    def discard(self) -> None:
        """Forget whatever arrived (idempotent)."""
        self._pieces = None

    def _claim(self, num_bytes: int) -> None:
        if self._pieces is None:
            raise RuntimeError("this KV assembler is finished or discarded")
        if self._bytes_placed + num_bytes > self.header.total_bytes:
            raise KVDataLoss(f"KV stream for {self.header.request_id!r} sent more than the "
                             f"{self.header.total_bytes} bytes its header announced")
        self._bytes_placed += num_bytes

    def _place(self, view: memoryview) -> None:
        """File ``view``'s bytes under the tensors they belong to, as views (or, landed,
        write them where they belong)."""
        taken, size = 0, len(view)
        while taken < size:
            count = min(self._sizes[self._segment] - self._offset, size - taken)
            writer = self._writers[self._segment]
            if writer is None:
                self._pieces[self._segment].append(view[taken:taken + count])
            else:
                writer.write(view[taken:taken + count])
            taken += count
            self._advance(count)

    def _advance(self, num_bytes: int) -> None:
        self._offset += num_bytes
        if self._offset == self._sizes[self._segment]:
            self._segment, self._offset = self._segment + 1, 0

    def _unpack(self, pieces: list[list[memoryview]]
                ) -> list[LayerKV | ReceivedLayer] | list[LandedLayer]:
        header = self.header
        dtype = DTYPES[header.dtype]
        swap = header.byte_order != sys.byteorder

        def whole(segment: list[memoryview], element_dtype: torch.dtype) -> torch.Tensor:
            raw = joined(segment)
            if swap:  # reverse the bytes of every element (only across byte orders)
                raw = raw.view(-1, element_dtype.itemsize).flip(1).reshape(-1)
            return raw.view(element_dtype)

        def layer(positions: torch.Tensor, k: list[memoryview], v: list[memoryview]
                  ) -> LayerKV | ReceivedLayer:
            if swap:
                shape = (positions.shape[0], header.num_kv_heads, header.head_dim)
                return LayerKV(whole(k, dtype).view(shape), whole(v, dtype).view(shape), positions)
            return ReceivedLayer(positions, tuple(k), tuple(v), dtype, header.num_kv_heads,
                                 header.head_dim)

        if header.layout == LAYER_MAJOR:
            positions = [whole(pieces[3 * index], POSITION_DTYPE) for index in range(header.num_layers)]
            keys_and_values = [pieces[3 * index + 1:3 * index + 3] for index in range(header.num_layers)]
        else:
            all_positions = whole(pieces[0], POSITION_DTYPE)
            ends = list(itertools.accumulate(header.layer_num_tokens))
            positions = [all_positions[end - count:end]
                         for end, count in zip(ends, header.layer_num_tokens)]
            keys_and_values = [pieces[1 + 2 * index:3 + 2 * index] for index in range(header.num_layers)]
        if self.landing is not None:
            return [LandedLayer(layer_positions, self.landing) for layer_positions in positions]
        return [layer(layer_positions, *kv) for layer_positions, kv in zip(positions, keys_and_values)]

    def _check_positions(self, layers: list[LayerKV]) -> None:
        for index, layer in enumerate(layers):
            positions = layer.positions
            first, last = int(positions[0]), int(positions[-1])
            if first < 0 or last >= self.spec.max_tokens:
                raise KVMalformed(f"KV layer {index} has positions {first}..{last}; "
                                  f"must lie in 0..{self.spec.max_tokens - 1}")
            if not bool((positions[1:] > positions[:-1]).all()):
                raise KVMalformed(f"KV layer {index} positions are not strictly increasing")
