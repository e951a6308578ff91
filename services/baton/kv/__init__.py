"""KV caches: the paged pool (split by role: see baton.kv.pool) and a dense per-sequence cache."""

from baton.kv.dense import DenseKV, LayerKV
from baton.kv.pool import KVPool, KVPoolExhausted, PagedSequenceKV

__all__ = ["DenseKV", "KVPool", "KVPoolExhausted", "LayerKV", "PagedSequenceKV"]
