"""A cache of every KV head (a prefill chain's transport) under a tensor-parallel rank's forward.

A chain's ranks hand each other whole caches: the transport (``RunaheadKV``, ``AllGatherKV``)
stores and exchanges every head, on the chain's own process group, which only each chain
rank's leader belongs to. Under tensor parallelism a layer's new keys and values are spread
over the group's ranks, so the leader joins them (``HeadGather``), extends the transport with
every head, and hands each rank back its own heads of what the layer attends to (one
broadcast of the joined cache): every rank then attends as in one process, and the transport
(and the tail's shipment) sees the cache whole.
"""

from __future__ import annotations

import torch
from baton.model.forward_batch import SequenceKV
from baton.model.sharding import HeadGather, ShardLayout


def _own_heads(layout: ShardLayout, k: torch.Tensor, v: torch.Tensor):
    heads = slice(layout.first_kv_head, layout.first_kv_head + layout.num_kv_heads)
    return k[:, heads].contiguous(), v[:, heads].contiguous()


class GatheredKV:
    """The leader's side: ``inner`` holds every head."""

    def __init__(self, inner: SequenceKV, heads: HeadGather, group) -> None:
        self.inner = inner
        self.heads = heads
        self.group = group

    def extend(self, layer: int, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor):
        k_all, v_all, key_positions = self.inner.extend(layer, self.heads.keys(k),
                                                        self.heads.keys(v), positions)
        self.group.broadcast((k_all.cpu(), v_all.cpu(), key_positions.cpu()))
        return (*_own_heads(self.heads.layout, k_all, v_all), key_positions)


class GatheredKVFollower:
    """A follower's side of a ``GatheredKV``: it gives its heads and takes its share back."""

    def __init__(self, heads: HeadGather, group, device: torch.device) -> None:
        self.heads = heads
        self.group = group
        self.device = device

    def extend(self, layer: int, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor):
        self.heads.keys(k)
        self.heads.keys(v)
        k_all, v_all, key_positions = self.group.broadcast()
        k_mine, v_mine = _own_heads(self.heads.layout, k_all, v_all)
        return k_mine.to(self.device), v_mine.to(self.device), key_positions.to(self.device)
