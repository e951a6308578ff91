"""KV caches: the paged pool, a dense per-sequence cache, and the wire codec."""

from baton.kv.dense import DenseKV, LayerKV
from baton.kv.pool import KVPool, KVPoolExhausted, PagedSequenceKV

__all__ = ["DenseKV", "KVPool", "KVPoolExhausted", "LayerKV", "PagedSequenceKV"]
