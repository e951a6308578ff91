"""The paged KV pool: fixed-size blocks, one block table per (sequence, layer).

Design: K and V for all layers share one pool of blocks ([num_blocks,
block_size, Hkv, D] each); a block belongs to one (sequence, layer). Layers
hold different numbers of tokens once PyramidInfer has pruned them, so each
(sequence, layer) has its own block table and length. Every stored token keeps
its original position (RoPE was applied with it; masks compare it).

The pool is what admission control counts: ``blocks_needed`` and ``reserve``
let an engine check and claim room for a whole step up front (all layers or
none), so a forward never runs out half way; running out raises
``KVPoolExhausted`` and never crashes.

With a prefix cache (``baton.kv.prefix_cache``) a sequence's tables may start with
cached blocks it shares with others: ``attach_prefix`` hands them to a new
sequence, ``cache_blocks`` registers a sequence's computed full blocks, ``free``
returns only its private blocks and drops its references. Cached blocks nobody
holds count as free: the pool takes them back (least recently used first) when
its free list runs dry.

Data moves with ``index_select`` / ``index_copy_`` over the first dimension
(blocks to read, token slots to write): on CPU that is ~10x faster than
advanced indexing (``cache[index]``), which decode steps would otherwise pay
on every layer.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from baton.errors import ResourceExhausted
from baton.host_memory import huge_page_zeros
from baton.host_to_device import to_device
from baton.kv.decode_step import BatchTables, DecodeSteps
from baton.kv.dense import LayerKV
from baton.kv.device_copy import DeviceLayer
from baton.kv.prefix_cache import CachedBlock, PrefixCache
from baton.kv.received import LandedLayer, Landing, ReceivedLayer, copy_pieces


class KVPoolExhausted(ResourceExhausted, RuntimeError):
    """The pool has too few free blocks for a request (names both numbers)."""

    def __init__(self, blocks_needed: int, blocks_free: int) -> None:
        super().__init__(f"KV pool exhausted: need {blocks_needed} blocks, {blocks_free} free")
        self.blocks_needed = blocks_needed
        self.blocks_free = blocks_free


@dataclass
class _LayerTable:
    blocks: list[int] = field(default_factory=list)
    length: int = 0


@dataclass
class _CachedPrefix:
    """A sequence's part in the prefix cache."""

    held: list[CachedBlock] = field(default_factory=list)  # cached blocks it holds a reference to
    num_blocks_seen: int = 0  # its leading full blocks already cached or found cached elsewhere


class KVPool(DecodeSteps):
    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, block_size: int,
                 num_blocks: int, dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu", cache_prefixes: bool = False) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"KV pool needs num_blocks >= 1 and block_size >= 1, "
                             f"got {num_blocks} and {block_size}")
        self.num_layers = num_layers
        self.block_size = block_size
        self.num_blocks = num_blocks
        shape = (num_blocks, block_size, num_kv_heads, head_dim)
        self.k_cache = self._zeros(shape, dtype, device)
        self.v_cache = self._zeros(shape, dtype, device)
        self.positions = torch.zeros((num_blocks, block_size), dtype=torch.int64, device=device)
        # A host cache's storage as bytes: received KV is copied into its blocks as it lies.
        self._k_bytes, self._v_bytes = (
            (memoryview(cache.view(-1).view(torch.uint8).numpy()) for cache in (self.k_cache, self.v_cache))
            if self.k_cache.device.type == "cpu" else (None, None))
        self._free: list[int] = list(range(num_blocks - 1, -1, -1))  # pop() hands out low ids first
        self._tables: dict[str, list[_LayerTable]] = {}
        self.prefix_cache = PrefixCache(num_layers) if cache_prefixes else None
        self._prefixes: dict[str, _CachedPrefix] = {}  # sequences holding or writing cached blocks
        # The last ungrouped decode batch's block tables (see BatchTables); dropped whenever
        # blocks are taken from a sequence, which appending alone never does.
        self._batch: BatchTables | None = None
        self._scratch: int | None = None  # see scratch_block

    @staticmethod
    def _zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
        """The cache's storage: on a CPU in huge pages (decode reads its blocks at random)."""
        if torch.device(device).type == "cpu":
            return huge_page_zeros(shape, dtype)
        return torch.zeros(shape, dtype=dtype, device=device)

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
            table = tables[layer] if tables else _LayerTable()
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
        tables = self._tables.setdefault(seq_id, [_LayerTable() for _ in range(self.num_layers)])
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

    # --- prefix cache ----------------------------------------------------------------------

    def match_prefix(self, hashes: list[bytes]) -> list[CachedBlock]:
        """The cached blocks of the longest prefix of ``hashes`` (none without a cache)."""
        return self.prefix_cache.match(hashes) if self.prefix_cache else []

    def attach_prefix(self, seq_id: str, blocks: list[CachedBlock]) -> None:
        """Start a new sequence's KV with cached blocks (a reference each): every layer then
        holds their ``len(blocks) * block_size`` tokens, and new tokens go after them."""
        if seq_id in self._tables:
            raise ValueError(f"sequence {seq_id!r} already holds KV in this pool")
        if not blocks:
            return
        self.prefix_cache.acquire(blocks)
        length = len(blocks) * self.block_size
        self._tables[seq_id] = [_LayerTable([block.blocks[layer] for block in blocks], length)
                                for layer in range(self.num_layers)]
        self._prefixes[seq_id] = _CachedPrefix(list(blocks), len(blocks))

    def cache_blocks(self, seq_id: str, hashes: list[bytes]) -> int:
        """Register the sequence's full blocks named by ``hashes`` (``hashes[i]``: its tokens
        up to the end of block ``i``, computed in every layer, unpruned) that are not cached
        yet; returns how many it registered. A block whose hash another sequence registered
        first stays private to this one."""
        if self.prefix_cache is None or seq_id not in self._tables:
            return 0
        prefix = self._prefixes.setdefault(seq_id, _CachedPrefix())
        tables = self._tables[seq_id]
        full = min(len(hashes), min(table.length for table in tables) // self.block_size)
        registered = 0
        for index in range(prefix.num_blocks_seen, full):
            block = self.prefix_cache.insert(hashes[index], [table.blocks[index] for table in tables])
            if block is not None:
                prefix.held.append(block)
                registered += 1
        prefix.num_blocks_seen = max(prefix.num_blocks_seen, full)
        return registered

    # --- data ------------------------------------------------------------------------------

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
        self._write(slots, k, v, positions)

    def gather(self, seq_id: str, layer: int) -> LayerKV:
        """One layer of one sequence as contiguous tensors (a copy)."""
        table = self._tables[seq_id][layer]
        index = to_device(table.blocks, self.k_cache.device)
        return LayerKV(*(self._rows(cache, index, table.length)
                         for cache in (self.k_cache, self.v_cache, self.positions)))

    def keys(self, seq_id: str, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """One layer of one sequence's keys [n, Hkv, D] and their positions [n] (copies):
        ``gather`` without the values, for a reader that scores."""
        table = self._tables[seq_id][layer]
        index = to_device(table.blocks, self.k_cache.device)
        return (self._rows(self.k_cache, index, table.length),
                self._rows(self.positions, index, table.length))

    @staticmethod
    def _rows(cache: torch.Tensor, blocks: torch.Tensor, length: int) -> torch.Tensor:
        """The first ``length`` token rows of ``blocks`` of a ``[blocks, block_size, ...]``
        tensor, in order (a copy)."""
        return cache.index_select(0, blocks).view((-1,) + cache.shape[2:])[:length]

    def store(self, seq_id: str,
              layers: list[LayerKV | ReceivedLayer | DeviceLayer] | list[LandedLayer]) -> None:
        """Put a whole (possibly pyramid-shaped) cache into the pool, all layers or none. A
        cache as it arrived over the wire is copied from its pieces straight into the blocks;
        one that ``land``-ed in them already only takes its positions; one on its way to the
        device (``baton.kv.device_copy.to_device``) is read once its copy is done."""
        if len(layers) != self.num_layers:
            raise ValueError(f"cache has {len(layers)} layers, the pool {self.num_layers}")
        if all(isinstance(layer, LandedLayer) for layer in layers):
            self._settle(seq_id, layers)
            return
        if seq_id in self._tables:
            raise ValueError(f"sequence {seq_id!r} already holds KV in this pool")
        self.reserve(seq_id, [layer.num_tokens for layer in layers])
        for index, layer in enumerate(layers):
            if isinstance(layer, DeviceLayer):  # still on its way from the host, maybe
                layer.wait_on(torch.cuda.current_stream(self.k_cache.device))
            if isinstance(layer, ReceivedLayer) and self.takes_bytes(
                    layer.dtype, layer.num_kv_heads, layer.head_dim):
                self._store_pieces(self._tables[seq_id][index], layer)
            else:
                self.append(seq_id, index, layer.k, layer.v, layer.positions)

    def takes_bytes(self, dtype: torch.dtype, num_kv_heads: int, head_dim: int) -> bool:
        """Whether keys and values of this dtype and shape are the blocks' bytes as they are:
        a host pool of the same dtype and shape."""
        return (self._k_bytes is not None and dtype == self.k_cache.dtype
                and (num_kv_heads, head_dim) == tuple(self.k_cache.shape[2:]))

    def land(self, layer_num_tokens: list[int]) -> Landing:
        """Claim blocks for a cache still arriving (all layers or none: KVPoolExhausted),
        and say where its keys and values go (a host pool only: ``takes_bytes``). Once they
        are in, ``store`` gives them to a sequence with their positions (``LandedLayer``);
        until then the landing holds the blocks, empty, and ``free(landing)`` returns them."""
        assert self._k_bytes is not None, "only a host pool takes bytes"
        landing = Landing([])
        self.reserve(landing, list(layer_num_tokens))
        landing.targets.extend(
            (self._block_bytes(self._k_bytes, table.blocks, count),
             self._block_bytes(self._v_bytes, table.blocks, count))
            for table, count in zip(self._tables[landing], layer_num_tokens))
        return landing

    def _settle(self, seq_id: str, layers: list[LandedLayer]) -> None:
        """A landed cache's bytes are all in its blocks: they become ``seq_id``'s, with the
        positions written and the tokens counted."""
        landing = layers[0].landing
        if landing not in self._tables or any(layer.landing is not landing for layer in layers):
            raise ValueError(f"the cache for sequence {seq_id!r} did not land in this pool")
        if seq_id in self._tables:
            raise ValueError(f"sequence {seq_id!r} already holds KV in this pool")
        tables = self._tables[seq_id] = self._tables.pop(landing)
        for table, layer in zip(tables, layers):
            if len(table.blocks) != self.blocks_for(layer.num_tokens):
                raise ValueError(f"sequence {seq_id!r} landed {len(table.blocks)} blocks for "
                                 f"{layer.num_tokens} tokens")
            self._store_positions(table, layer.positions)

    def _store_pieces(self, table: _LayerTable, layer: ReceivedLayer) -> None:
        """Copy a received layer's keys and values from their pieces into the table's (fresh)
        blocks, each byte once: consecutive blocks are one range."""
        count = layer.num_tokens
        for cache_bytes, pieces in ((self._k_bytes, layer.k_pieces), (self._v_bytes, layer.v_pieces)):
            copy_pieces(pieces, self._block_bytes(cache_bytes, table.blocks, count))
        self._store_positions(table, layer.positions)

    def _store_positions(self, table: _LayerTable, positions: torch.Tensor) -> None:
        """The positions of a table's (empty) blocks' tokens, whose keys and values are in."""
        count = positions.shape[0]
        index = to_device(self._slots(table, count), self.positions.device)
        self.positions.view(-1).index_copy_(0, index, positions.to(torch.int64))
        table.length = count

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

    def retain(self, seq_id: str, layer: int, keep: torch.Tensor) -> None:
        """Keep only the tokens at sorted indices ``keep`` of one layer; frees emptied blocks.

        The kept tokens move down in place, in order: those before the first dropped one
        stay where they are, so a pruned batch in the middle moves only what follows it."""
        assert seq_id not in self._prefixes or not self._prefixes[seq_id].held, \
            "pruning a sequence that shares cached blocks"
        table = self._tables[seq_id][layer]
        keep = keep.to("cpu", torch.int64)
        count = keep.numel()
        unmoved = int((keep == torch.arange(count)).sum())  # sorted and distinct: a prefix
        if unmoved < count:
            slots = self._token_slots(table)
            source = to_device(slots[keep[unmoved:]], self.k_cache.device)
            target = to_device(slots[unmoved:count], self.k_cache.device)
            tokens = self.num_blocks * self.block_size
            for cache in (self.k_cache, self.v_cache, self.positions):
                flat = cache.view(tokens, *cache.shape[2:])
                flat.index_copy_(0, target, flat.index_select(0, source))
        surplus = table.blocks[self.blocks_for(count):]
        del table.blocks[self.blocks_for(count):]
        self._free.extend(reversed(surplus))
        table.length = count
        if surplus and self._batch is not None:  # its first blocks stay: the row is shorter
            self._batch.truncate(seq_id, layer, len(table.blocks))

    def scratch_block(self) -> int:
        """A block no sequence holds, set aside for good on first call: a padded decode batch
        (a CUDA graph's rows past the real batch) writes its dummy tokens there. Raises
        ``KVPoolExhausted`` when no block is free."""
        if self._scratch is None:
            if self.num_free_blocks < 1:
                raise KVPoolExhausted(1, 0)
            self._scratch = self._take_block()
        return self._scratch

    def _token_slots(self, table: _LayerTable) -> torch.Tensor:
        """Flat slot numbers of a table's tokens, in order (a host tensor)."""
        blocks = torch.tensor(table.blocks, dtype=torch.int64)
        return (blocks[:, None] * self.block_size + torch.arange(self.block_size)).view(-1)[:table.length]

    def _slots(self, table: _LayerTable, count: int) -> torch.Tensor:
        """Flat slot numbers (block * block_size + offset) of a table's next ``count`` tokens, as
        a host tensor: made from the blocks they fall in, so that a prompt's write costs a few
        tensor ops per layer rather than Python work per token."""
        size = self.block_size
        first, end = table.length // size, self.blocks_for(table.length + count)
        blocks = to_device(table.blocks[first:end], "cpu")
        slots = (blocks[:, None] * size + torch.arange(size)).view(-1)
        start = table.length - first * size
        return slots[start:start + count]

    def _write(self, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               positions: torch.Tensor) -> None:
        self._write_at(to_device(slots, self.k_cache.device), k, v, positions)

    def _write_at(self, index: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                  positions: torch.Tensor) -> None:
        """Write tokens to flat slots ``index``, one ``index_copy_`` per tensor. The tokens may
        come from another device or dtype (a cache from the wire or a chain arrives in host
        memory)."""
        device = self.k_cache.device
        tokens = self.num_blocks * self.block_size
        self.k_cache.view(tokens, *self.k_cache.shape[2:]).index_copy_(
            0, index, k.to(device, self.k_cache.dtype))
        self.v_cache.view(tokens, *self.v_cache.shape[2:]).index_copy_(
            0, index, v.to(device, self.v_cache.dtype))
        self.positions.view(tokens).index_copy_(0, index, positions.to(device, torch.int64))

    def view(self, seq_id: str) -> PagedSequenceKV:
        return PagedSequenceKV(self, seq_id)


class PagedSequenceKV:
    """``SequenceKV`` over one sequence in a ``KVPool``."""

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
