"""The prefix cache: full KV blocks kept after their request ends, found again by their hash.

Design (after vLLM's block hashes and SGLang's radix cache): a *cached block* is
``block_size`` tokens of one sequence, held in every layer (one pool block per
layer). It is named by a hash chained over everything that decides its bytes: the
hash of the block before it, its token ids, and, at the chain's root, the model
revision, the KV dtype and a per-tenant salt. Two requests under different salts
never share a block (a hit is observable as time, so sharing across tenants would
leak what others asked); two pods serving different revisions or dtypes name the
same tokens differently.

Life of a cached block: the request that computed it registers it once all its
layers hold it (never while it is being written); every request whose prompt
starts with the same tokens may then take it (a reference each). Blocks are
only ever read by the requests holding them: new tokens go to blocks after the
cached ones, and a request that compresses its KV compresses a private copy.
When the last reference goes the block stays cached but *evictable*; the pool
takes evictable blocks back, least recently used first, only when it has no free
block left, so the cache uses exactly the room nobody else needs.

The cache also keeps a journal of what it stored and evicted (numbered, bounded)
for a router to follow which prefixes this pool holds.
"""

from __future__ import annotations

import hashlib
import itertools
from array import array
from collections import OrderedDict, deque
from collections.abc import Sequence
from dataclasses import dataclass, field

HASH_BYTES = 16  # blake2b-128: collisions are out of reach, and it is cheap beside a block's KV
JOURNAL_LENGTH = 65536  # store/evict events kept for routers to read (older ones are dropped)


def cache_root(model_revision: str, kv_dtype: str, salt: str = "") -> bytes:
    """The hash every chain of block hashes starts from: the model revision, the KV dtype and
    the tenant's salt (empty: no tenant separation)."""
    key = f"{model_revision}\0{kv_dtype}\0{salt}".encode()
    return hashlib.blake2b(key, digest_size=HASH_BYTES, person=b"baton-kv-root").digest()


def extend_block_hashes(hashes: list[bytes], token_ids: Sequence[int], block_size: int,
                        root: bytes) -> list[bytes]:
    """Append to ``hashes`` the hashes of the full blocks of ``token_ids`` it lacks; returns it.

    ``hashes[i]`` names tokens ``[0, (i + 1) * block_size)`` under ``root``."""
    parent = hashes[-1] if hashes else root
    for start in range(len(hashes) * block_size, len(token_ids) - block_size + 1, block_size):
        tokens = array("I", token_ids[start:start + block_size]).tobytes()
        parent = hashlib.blake2b(parent + tokens, digest_size=HASH_BYTES).digest()
        hashes.append(parent)
    return hashes


@dataclass(eq=False)
class CachedBlock:
    hash: bytes
    blocks: list[int]  # the pool block holding these tokens, one per layer
    refs: int = 0  # requests holding it; 0 = evictable


@dataclass
class CacheStats:
    """Counters since the pool started (for metrics and benchmarks)."""

    lookups: int = 0  # requests that looked for a prefix
    hits: int = 0  # ... and found at least one block
    tokens_looked_up: int = 0  # prompt tokens those requests could have taken from the cache
    tokens_hit: int = 0  # ... and took
    stored: int = 0  # blocks registered
    evicted: int = 0  # blocks taken back by the pool


@dataclass(frozen=True)
class CacheEvent:
    sequence: int  # numbers every event of this cache, from 1, without gaps
    stored: bool  # True: the block was stored; False: evicted
    hash: bytes


@dataclass
class PrefixCache:
    num_layers: int
    _by_hash: dict[bytes, CachedBlock] = field(default_factory=dict)
    # refs == 0, least recently used first
    _evictable: OrderedDict[bytes, CachedBlock] = field(default_factory=OrderedDict)
    _owner: dict[int, CachedBlock] = field(default_factory=dict)  # pool block -> its cached block
    stats: CacheStats = field(default_factory=CacheStats)
    journal: deque[CacheEvent] = field(default_factory=lambda: deque(maxlen=JOURNAL_LENGTH))
    _next_event: int = 1

    @property
    def num_cached_blocks(self) -> int:
        """Cached blocks (each holds ``num_layers`` pool blocks)."""
        return len(self._by_hash)

    @property
    def num_evictable_pool_blocks(self) -> int:
        return len(self._evictable) * self.num_layers

    def owns(self, pool_block: int) -> bool:
        return pool_block in self._owner

    def match(self, hashes: Sequence[bytes]) -> list[CachedBlock]:
        """The cached blocks of the longest prefix of ``hashes`` this cache holds."""
        found = []
        for block_hash in hashes:
            block = self._by_hash.get(block_hash)
            if block is None:
                break
            found.append(block)
        return found

    def acquire(self, blocks: list[CachedBlock]) -> None:
        for block in blocks:
            if block.refs == 0:
                del self._evictable[block.hash]
            block.refs += 1

    def release(self, blocks: list[CachedBlock]) -> None:
        """Drop one reference to each; the last ones become evictable, the prefix's tail
        before its head (so a shorter prefix outlives a longer one)."""
        for block in reversed(blocks):
            block.refs -= 1
            assert block.refs >= 0, "a cached block released more often than acquired"
            if block.refs == 0:
                self._evictable[block.hash] = block

    def insert(self, block_hash: bytes, pool_blocks: list[int]) -> CachedBlock | None:
        """Register a computed block, held by its writer (one reference). None when the
        hash is cached already (another request computed the same tokens): the caller keeps
        its copy private."""
        if block_hash in self._by_hash:
            return None
        assert len(pool_blocks) == self.num_layers, "a cached block spans every layer"
        block = CachedBlock(block_hash, list(pool_blocks), refs=1)
        self._by_hash[block_hash] = block
        for pool_block in pool_blocks:
            self._owner[pool_block] = block
        self.stats.stored += 1
        self._log(True, block_hash)
        return block

    def evict(self) -> list[int]:
        """Forget the least recently used evictable block; its pool blocks, now free."""
        block_hash, block = self._evictable.popitem(last=False)
        del self._by_hash[block_hash]
        for pool_block in block.blocks:
            del self._owner[pool_block]
        self.stats.evicted += 1
        self._log(False, block_hash)
        return block.blocks

    def count_lookup(self, tokens_looked_up: int, tokens_hit: int) -> None:
        self.stats.lookups += 1
        self.stats.hits += tokens_hit > 0
        self.stats.tokens_looked_up += tokens_looked_up
        self.stats.tokens_hit += tokens_hit

    def events_after(self, sequence: int) -> list[CacheEvent]:
        """Journal events numbered above ``sequence`` (a reader that sees a gap before the
        first one has missed some and must resynchronise from ``hashes()``)."""
        if not self.journal:
            return []
        skip = max(0, sequence + 1 - self.journal[0].sequence)  # the journal's numbers are contiguous
        return list(itertools.islice(self.journal, skip, None))

    def hashes(self) -> list[bytes]:
        """Every cached block's hash (a snapshot for a reader that resynchronises)."""
        return list(self._by_hash)

    @property
    def last_event(self) -> int:
        return self._next_event - 1

    def _log(self, stored: bool, block_hash: bytes) -> None:
        self.journal.append(CacheEvent(self._next_event, stored, block_hash))
        self._next_event += 1
