"""What the leader of a tensor-parallel group tells the others about a forward: the inputs and
the attention metadata the runner built (``PrefillSegment``, ``DecodeStep``), with each cache
named by its pool instead of its storage. A follower rebuilds the same metadata over its own
storage (``Replica``), so every rank writes and reads the same slots of its own heads.

An observed segment or decode row (PyramidInfer's) has every head gathered for it on every
rank (``HeadGather``): a follower's forward joins those gathers with a stand-in observer.

A dense cache (``DenseKV``: a step measured on a fresh one, a prompt prefilled outside a pool)
is named by the leader's object: a follower keeps its own beside it while the leader's lives.
A chain's cache of every head (``GatheredKV``) has a follower's side of its own.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import torch
from baton.kv.decode_step import DecodeGroup, DecodeStep
from baton.kv.dense import DenseKV
from baton.kv.pool import KVPool
from baton.kv.prefill_step import PrefillSegment
from baton.kv.storage import KVStorage
from baton.model.forward_batch import DecodeBatch, Segment
from baton.model.sharding import HeadGather
from baton.parallel.gathered_kv import GatheredKV, GatheredKVFollower

DENSE_CACHES_KEPT = 64  # a follower's dense caches, oldest dropped first


@dataclass(frozen=True)
class PoolGeometry:
    """What a follower needs to build storage like the leader's pool (its own heads)."""

    key: int
    num_layers: int
    block_size: int
    num_blocks: int
    dtype: torch.dtype  # the compute dtype
    storage: KVStorage  # what the blocks hold


def pool_geometry(key: int, pool: KVPool) -> PoolGeometry:
    return PoolGeometry(key, pool.num_layers, pool.block_size, pool.num_blocks,
                        pool.compute_dtype, pool.storage)


class StepEncoder:
    """The leader's side: a forward's arguments as a message (tensors on the host)."""

    def __init__(self) -> None:
        self.pool_keys: dict[int, int] = {}  # id of a pool's key storage -> its key

    def key_of(self, k_cache: torch.Tensor) -> int:
        key = self.pool_keys.get(id(k_cache))
        if key is None:
            raise ValueError("a forward under tensor parallelism read a pool its group does not share")
        return key

    def forward(self, token_ids, positions, segments, output_rows, decode) -> tuple:
        return ("forward", token_ids.cpu(), positions.cpu(),
                [self._segment(segment) for segment in segments],
                None if output_rows is None else output_rows.cpu(),
                None if decode is None else self._decode(decode))

    def _segment(self, segment: Segment) -> tuple:
        kv, observed = segment.kv, segment.observer is not None
        if isinstance(kv, PrefillSegment):
            return (segment.length, observed, "paged", self.key_of(kv.k_cache), _host(kv.slots),
                    _host(kv.blocks), list(kv.lengths))
        if isinstance(kv, DenseKV):
            return (segment.length, observed, "dense", id(kv), len(kv.layers),
                    all(layer is None for layer in kv.layers))
        if isinstance(kv, GatheredKV):
            return (segment.length, observed, "gathered")
        raise ValueError(f"a {type(kv).__name__} cannot be sharded over a tensor-parallel group")

    def _decode(self, decode: DecodeBatch) -> tuple:
        assert not decode.record_queries, "a CUDA graph's decode step is not sharded"
        step = decode.step
        groups = [(group.rows, _host(group.blocks), group.lengths.cpu(), group.uniform)
                  for group in step.groups]
        observed = [observer is not None for observer in decode.observers]
        return (self.key_of(step.k_cache), step.slots.cpu(), groups, observed)


class _JoinsGathers:
    """A follower's stand-in for the leader's observer of a segment or a decode row: the
    forward gathers every head for it (the leader's observer reads them), and it reads none."""

    def observe(self, layer, q, query_positions, k, key_positions) -> None:
        pass

    def observe_decode(self, queries, position) -> None:
        pass


JOINS_GATHERS = _JoinsGathers()


class Replica:
    """A follower's side: its storage for each of the leader's pools, and the forward's
    arguments rebuilt over them."""

    def __init__(self, num_kv_heads: int, head_dim: int, device: torch.device,
                 heads: HeadGather | None = None, group=None) -> None:
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.device = device
        self.heads = heads  # for a chain's cache of every head (``GatheredKV``)
        self.group = group
        self.pools: dict[int, KVPool] = {}
        self.dense: OrderedDict[int, DenseKV] = OrderedDict()

    def add_pool(self, geometry: PoolGeometry) -> None:
        self.pools[geometry.key] = KVPool(geometry.num_layers, self.num_kv_heads, self.head_dim,
                                          geometry.block_size, geometry.num_blocks,
                                          geometry.dtype, self.device, storage=geometry.storage)

    def forward_arguments(self, message: tuple) -> tuple:
        _, token_ids, positions, segments, output_rows, decode = message
        device = self.device
        return (token_ids.to(device), positions.to(device),
                [self._segment(segment) for segment in segments],
                None if output_rows is None else output_rows.to(device),
                None if decode is None else self._decode(decode))

    def _segment(self, described: tuple) -> Segment:
        length, observed, kind = described[:3]
        observer = JOINS_GATHERS if observed else None
        if kind == "paged":
            key, slots, blocks, lengths = described[3:]
            pool = self.pools[key]
            return Segment(length, PrefillSegment(self._on_device(slots), self._on_device(blocks),
                                                  lengths, pool.k_cache, pool.v_cache, pool.positions,
                                                  pool.storage),
                           observer)
        if kind == "gathered":
            return Segment(length, GatheredKVFollower(self.heads, self.group, self.device), observer)
        leader_id, num_layers, fresh = described[3:]
        if fresh or leader_id not in self.dense:
            self.dense[leader_id] = DenseKV(num_layers)
            while len(self.dense) > DENSE_CACHES_KEPT:
                self.dense.popitem(last=False)
        return Segment(length, self.dense[leader_id], observer)

    def _decode(self, described: tuple) -> DecodeBatch:
        key, slots, groups, observed = described
        pool = self.pools[key]
        step = DecodeStep(slots.to(self.device),
                          [DecodeGroup(rows, self._on_device(blocks), lengths.to(self.device), uniform)
                           for rows, blocks, lengths, uniform in groups],
                          pool.k_cache, pool.v_cache, pool.positions, pool.storage)
        return DecodeBatch(step, [JOINS_GATHERS if seen else None for seen in observed])

    def _on_device(self, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        return [tensor.to(self.device) for tensor in tensors]


def _host(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    return [tensor.cpu() for tensor in tensors]


def read_every_head(pool: KVPool, heads: HeadGather, blocks: torch.Tensor, length: int,
                    with_values: bool):
    """A pool read (``KVPool.own_rows``) on every rank alike, the heads joined: what each rank
    runs for the leader's ``read``."""
    k, v, positions = pool.own_rows(blocks.to(pool.k_cache.device), length, with_values)
    return heads.keys(k), None if v is None else heads.keys(v), positions
