"""How K,V moves between the ranks of a chain: KV-Runahead's relay and TSP's all-gather.

Both are ``SequenceKV`` objects handed to ``baton.model.prefill``, so a rank
runs the ordinary model forward and the cache transport happens inside
``extend(layer, ...)``, once per layer:

* ``RunaheadKV`` (KV-Runahead): rank i>0 posts one receive per layer at
  request start, before computing anything, into a preallocated buffer
  ``[b_{i+1}, 2, Hkv, D]`` whose first ``b_i`` rows are the prefix from rank
  i-1. ``extend`` waits for that layer's prefix, writes the rank's own K,V
  behind it and sends the whole buffer on to rank i+1 asynchronously (waited
  on only at the end), so the next layer's compute overlaps the send and the
  next rank's compute. Rank i sends ``b_{i+1}`` tokens per layer: the chain
  sends ``b_1 + ... + b_{p-1}``.
* ``AllGatherKV`` (TSP baseline): even slices; every rank all-gathers every
  layer's K,V (padded to the longest slice, as all-gather needs equal sizes)
  and attends its queries to the keys up to its own end: ``(p-1) * C`` tokens
  per layer over the chain.

Keys arrive with contiguous positions ``0..b_i``, so positions are not sent.
One code path for gloo (CPU tensors) and NCCL (CUDA tensors).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from baton.kv import LayerKV
from baton.runahead.errors import ChainError


@dataclass
class RankCounters:
    """What one rank moved and computed for one request."""

    bytes_sent: int = 0
    bytes_received: int = 0
    attention_dot_products: int = 0  # q.k products inside the causal mask, over heads and layers

    def as_list(self) -> list[int]:
        return [self.bytes_sent, self.bytes_received, self.attention_dot_products]


def causal_pairs(first_query: int, end: int) -> int:
    """(query, key) pairs a causal mask allows for queries ``first_query..end-1`` over keys 0.."""
    return (end * (end + 1) - first_query * (first_query + 1)) // 2


def _wait(work, message: str) -> None:
    try:
        work.wait()
    except RuntimeError as e:  # gloo: peer gone or timed out; NCCL: communicator aborted
        raise ChainError(f"{message}: {e}") from e


class _ChainKV:
    """What both transports share: the slice geometry, the counters and the tail's cache."""

    def __init__(self, rank: int, boundaries: Sequence[int], num_layers: int, num_heads: int,
                 num_kv_heads: int, head_dim: int, dtype: torch.dtype, device: torch.device) -> None:
        self.rank = rank
        self.num_ranks = len(boundaries) - 1
        self.boundaries = list(boundaries)
        self.start, self.end = self.boundaries[rank], self.boundaries[rank + 1]
        self.num_layers = num_layers
        self.num_heads = num_heads
        self.kv_shape = (2, num_kv_heads, head_dim)
        self.dtype, self.device = dtype, device
        self.token_bytes = 2 * num_kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()
        self.counters = RankCounters()
        self.key_positions = torch.arange(self.end, device=device)
        self.cache: list[LayerKV | None] = [None] * num_layers

    @property
    def is_tail(self) -> bool:
        return self.rank == self.num_ranks - 1

    def pass_through(self) -> None:
        """Take part in every layer's exchange without tokens of our own (an empty slice)."""
        empty = torch.empty((0,) + self.kv_shape[1:], dtype=self.dtype, device=self.device)
        no_positions = torch.empty(0, dtype=torch.int64, device=self.device)
        for layer in range(self.num_layers):
            self.extend(layer, empty, empty, no_positions)

    def layers(self) -> list[LayerKV]:
        """The full cache of every layer (the tail's result)."""
        assert all(layer is not None for layer in self.cache), "every layer must have run"
        return list(self.cache)  # type: ignore[arg-type]

    def _count_attention(self) -> None:
        self.counters.attention_dot_products += self.num_heads * causal_pairs(self.start, self.end)


class RunaheadKV(_ChainKV):
    """KV-Runahead's relay: receive the prefix from rank i-1, append our K,V, send on to rank i+1."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        # buffer[l]: [b_{i+1}, 2, Hkv, D]; rows :b_i come from rank i-1, the rest are ours.
        self.buffers = [torch.empty((self.end,) + self.kv_shape, dtype=self.dtype, device=self.device)
                        for _ in range(self.num_layers)]
        self.receives: list = []
        self.sends: list = []

    def post_receives(self) -> None:
        """Post every layer's receive before computing (rank 0 and empty prefixes have none)."""
        if self.start == 0:
            return
        for layer, buffer in enumerate(self.buffers):
            self.receives.append(dist.irecv(buffer[:self.start], src=self.rank - 1, tag=layer))
        self.counters.bytes_received += self.num_layers * self.start * self.token_bytes

    def extend(self, layer: int, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor):
        buffer = self.buffers[layer]
        if self.receives:
            _wait(self.receives[layer], f"rank {self.rank}: no K,V of layer {layer} "
                                        f"from rank {self.rank - 1}")
        buffer[self.start:, 0] = k
        buffer[self.start:, 1] = v
        if not self.is_tail and self.end > 0:
            self.sends.append(dist.isend(buffer, dst=self.rank + 1, tag=layer))
            self.counters.bytes_sent += self.end * self.token_bytes
        self._count_attention()
        keys, values = buffer[:, 0], buffer[:, 1]
        if self.is_tail:
            self.cache[layer] = LayerKV(keys, values, self.key_positions)
        return keys, values, self.key_positions

    def finish(self) -> None:
        """Wait until every send has left (the next rank holds what it needs)."""
        for layer, work in enumerate(self.sends):
            _wait(work, f"rank {self.rank}: K,V of layer {layer} not taken by rank {self.rank + 1}")
        self.sends.clear()


class AllGatherKV(_ChainKV):
    """TSP's all-gather: every rank gets every slice of every layer, padded to equal sizes."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.slice_lengths = [b - a for a, b in zip(self.boundaries, self.boundaries[1:])]
        self.padded_length = max(self.slice_lengths)

    def post_receives(self) -> None:
        """All-gather has nothing to post ahead: each layer's exchange is one collective."""

    def extend(self, layer: int, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor):
        # local: [padded, 2, Hkv, D]; gathered[j]: rank j's slice, padded the same way.
        local = torch.zeros((self.padded_length,) + self.kv_shape, dtype=self.dtype,
                            device=self.device)
        local[:k.shape[0], 0] = k
        local[:k.shape[0], 1] = v
        gathered = [torch.empty_like(local) for _ in range(self.num_ranks)]
        work = dist.all_gather(gathered, local, async_op=True)
        _wait(work, f"rank {self.rank}: all-gather of layer {layer} failed (a peer is gone)")
        moved = (self.num_ranks - 1) * self.padded_length * self.token_bytes
        self.counters.bytes_sent += moved
        self.counters.bytes_received += moved
        # Causal: rank i's queries only see slices 0..i.
        visible = torch.cat([gathered[j][:self.slice_lengths[j]] for j in range(self.rank + 1)])
        self._count_attention()
        keys, values = visible[:, 0], visible[:, 1]
        if self.is_tail:
            self.cache[layer] = LayerKV(keys, values, self.key_positions)
        return keys, values, self.key_positions

    def finish(self) -> None:
        """Collectives complete in ``extend``; nothing is left in flight."""
