"""Sharing a prompt's full blocks between sequences (the pool's side of the prefix cache).

A sequence's tables may start with cached blocks it shares with others: ``attach_prefix``
hands them to a new sequence, ``cache_blocks`` registers a sequence's computed full blocks,
and ``free`` (``baton.kv.tables``) returns only its private blocks and drops its references.
The index itself (hashes, references, eviction order) is ``baton.kv.prefix_cache``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from baton.kv.prefix_cache import CachedBlock, PrefixCache
from baton.kv.tables import LayerTable


@dataclass
class CachedPrefix:
    """A sequence's part in the prefix cache."""

    held: list[CachedBlock] = field(default_factory=list)  # cached blocks it holds a reference to
    num_blocks_seen: int = 0  # its leading full blocks already cached or found cached elsewhere


class PrefixBlocks:
    """``KVPool``'s part for the prefix cache: ``prefix_cache`` (None without one) and each
    sequence's ``CachedPrefix`` (``_prefixes``)."""

    def _init_prefixes(self, cache_prefixes: bool) -> None:
        self.prefix_cache = PrefixCache(self.num_layers) if cache_prefixes else None
        self._prefixes: dict[str, CachedPrefix] = {}  # sequences holding or writing cached blocks

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
        self._tables[seq_id] = [LayerTable([block.blocks[layer] for block in blocks], length)
                                for layer in range(self.num_layers)]
        self._prefixes[seq_id] = CachedPrefix(list(blocks), len(blocks))

    def cache_blocks(self, seq_id: str, hashes: list[bytes]) -> int:
        """Register the sequence's full blocks named by ``hashes`` (``hashes[i]``: its tokens
        up to the end of block ``i``, computed in every layer, unpruned) that are not cached
        yet; returns how many it registered. A block whose hash another sequence registered
        first stays private to this one."""
        if self.prefix_cache is None or seq_id not in self._tables:
            return 0
        prefix = self._prefixes.setdefault(seq_id, CachedPrefix())
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

    def shares_cached_blocks(self, seq_id: str) -> bool:
        prefix = self._prefixes.get(seq_id)
        return prefix is not None and bool(prefix.held)
