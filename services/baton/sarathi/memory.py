"""KV memory for the scheduler: admission, per-step reservation, preemption.

Design: the policy decides *what* runs; this module decides whether the pool
can hold it. A request is admitted only when the pool can hold KV for all of
its uncomputed tokens, and those blocks are claimed at admission, so a
chunked prefill never runs dry half way. Each decode claims its one new slot
before the step (``KVPool.reserve``: all layers or none); when the pool is
full the newest sequence is preempted — its blocks freed, its generated
tokens kept for a recompute later — so running out is never an
out-of-memory crash.

Prefix cache: at admission a prompt first takes the longest run of its full
blocks the cache holds (``KVPool.attach_prefix``) and counts as computed that
far, so the chunks and the token budget cover only the rest; after every
forward the blocks it completed are registered for later requests. The hit
stops where the sequence's compressor needs queries of its own
(``SequenceCompressor.cacheable_tokens``) and always leaves the last token to
compute, since that forward samples. A sequence registers blocks only while its
KV is whole: once compressed it holds a private, pruned copy.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from baton.config import KVPoolConfig
from baton.device_memory import free_memory_bytes
from baton.kv.pool import KVPool, KVPoolExhausted
from baton.kv.prefix_cache import cache_root, extend_block_hashes
from baton.kv.storage import KVStorage
from baton.model.config import ModelConfig
from baton.sarathi.request import Sequence, Status


def build_pool(model_config: ModelConfig, config: KVPoolConfig, dtype: torch.dtype,
               device: torch.device | str = "cpu", num_kv_heads: int = 0,
               storage: KVStorage | None = None) -> KVPool:
    """A pool sized by ``config``: ``num_blocks``, or as many as fit ``memory_fraction`` of
    the device's free memory (called once the weights are loaded), or ``memory_mib``.
    ``num_kv_heads``: the heads this rank holds (default: the model's); ``storage``: what
    its blocks hold (default: the compute ``dtype``)."""
    storage = storage or KVStorage(dtype)
    num_layers = model_config.num_hidden_layers
    num_kv_heads = num_kv_heads or model_config.num_key_value_heads
    num_blocks = config.num_blocks
    if num_blocks == 0:
        element_size = torch.empty(0, dtype=storage.dtype).element_size()
        bytes_per_block = (2 * config.block_size * num_kv_heads
                           * model_config.head_dim * element_size)
        if config.memory_fraction:
            memory = int(config.memory_fraction * free_memory_bytes(torch.device(device)))
            what = f"kv memory_fraction {config.memory_fraction:g} of the free memory"
        else:
            memory, what = config.memory_mib * 2**20, f"kv memory_mib {config.memory_mib}"
        num_blocks = memory // bytes_per_block
        if num_blocks < num_layers:
            raise ValueError(f"{what} holds {num_blocks} blocks, fewer than one per layer "
                             f"({num_layers}); give the pool more")
    return KVPool(num_layers, num_kv_heads, model_config.head_dim,
                  config.block_size, num_blocks, dtype=dtype, device=device,
                  cache_prefixes=config.prefix_cache, storage=storage)


class KVManager:
    def __init__(self, pool: KVPool, model_revision: str = "") -> None:
        self.pool = pool
        self.model_revision = model_revision
        self._roots: dict[str, bytes] = {}  # a hash chain's root per tenant salt

    def capacity_tokens(self) -> int:
        """The longest sequence the whole pool could hold (every layer full length)."""
        return self.pool.num_blocks // self.pool.num_layers * self.pool.block_size

    @property
    def num_layers(self) -> int:
        return self.pool.num_layers

    def try_admit(self, seq: Sequence, headroom_blocks: int = 0) -> bool:
        """Claim KV for the sequence's uncomputed tokens (or store KV from a chain), provided
        ``headroom_blocks`` stay free afterwards (room for running sequences to grow)."""
        if seq.arrived_kv is not None:
            needed = self.pool.blocks_needed(seq.request_id, [kv.num_tokens for kv in seq.arrived_kv])
            if needed + headroom_blocks > self.pool.num_free_blocks:
                return False
            whole = all(kv.num_tokens == len(seq.prompt_ids) for kv in seq.arrived_kv)
            self.pool.store(seq.request_id, seq.arrived_kv)
            seq.arrived_kv = None
            if whole:  # an uncompressed cache from a chain is cached like one computed here
                self.cache_computed(seq)
            return True
        num_hit = self._attach_cached_prefix(seq)
        needed = self.pool.blocks_needed(seq.request_id, seq.num_uncomputed)
        if needed + headroom_blocks > self.pool.num_free_blocks:
            if num_hit:
                self.pool.free(seq.request_id)
                seq.num_computed = 0
            return False
        self.pool.reserve(seq.request_id, seq.num_uncomputed)
        if self.pool.prefix_cache is not None:
            self.pool.prefix_cache.count_lookup(seq.num_tokens, num_hit)
            if seq.num_preemptions == 0:
                seq.num_cached_tokens = num_hit
        return True

    # --- prefix cache ----------------------------------------------------------------------

    def _attach_cached_prefix(self, seq: Sequence) -> int:
        """Start a fresh sequence with the cached blocks its tokens begin with; the tokens
        they hold (now counted as computed)."""
        if self.pool.prefix_cache is None or seq.num_computed or seq.collects_prompt_logprobs:
            return 0
        limit = seq.num_tokens - 1  # the last token is computed: its forward samples
        if seq.compressor is not None:
            limit = min(limit, seq.compressor.cacheable_tokens())
        size = self.pool.block_size
        hashes = self._hashes(seq, limit // size * size)
        blocks = self.pool.match_prefix(hashes[:limit // size])
        self.pool.attach_prefix(seq.request_id, blocks)
        seq.num_computed = len(blocks) * size
        return seq.num_computed

    def cache_computed(self, seq: Sequence) -> None:
        """After a forward: register the full blocks the sequence completed (while its KV is
        whole: prefilling, or decoding without compression)."""
        if self.pool.prefix_cache is None:
            return
        if seq.compressor is not None and seq.status is not Status.PREFILLING:
            return
        num_full = seq.num_computed // self.pool.block_size
        if num_full <= seq.num_blocks_registered:
            return
        hashes = self._hashes(seq, num_full * self.pool.block_size)
        self.pool.cache_blocks(seq.request_id, hashes[:num_full])
        seq.num_blocks_registered = num_full

    def _hashes(self, seq: Sequence, num_tokens: int) -> list[bytes]:
        """The sequence's block hashes covering at least its first ``num_tokens`` tokens."""
        size = self.pool.block_size
        if len(seq.block_hashes) * size < num_tokens:
            root = self._roots.get(seq.cache_salt)
            if root is None:
                root = cache_root(self.model_revision, self.pool.storage.name,
                                  seq.cache_salt)
                self._roots[seq.cache_salt] = root
            extend_block_hashes(seq.block_hashes, seq.token_ids[:num_tokens], size, root)
        return seq.block_hashes

    def reserve_decodes(self, running: list[Sequence], holders: list[Sequence]) -> DecodeGrant:
        """Claim one slot per decoding sequence, oldest first. Whenever the pool is full the
        newest of ``holders`` (every sequence holding KV, prefills in flight included) is
        preempted; a sequence that is alone in the pool and still cannot grow is out of room."""
        grant = DecodeGrant()
        holders = list(holders)
        queue = sorted(running, key=lambda s: s.arrival)
        while queue:
            seq = queue[0]
            try:
                self.pool.reserve(seq.request_id, 1)
            except KVPoolExhausted:
                victim = max(holders, key=lambda s: s.arrival)
                holders.remove(victim)
                self.release(victim)
                if victim is seq and not holders:
                    grant.out_of_room.append(victim)
                else:
                    grant.preempted.append(victim)
                for group in (queue, grant.decodes):
                    if victim in group:
                        group.remove(victim)
                continue
            grant.decodes.append(queue.pop(0))
        return grant

    def release(self, seq: Sequence) -> int:
        """Free every block of a sequence at once (finish, abort, preemption)."""
        return self.pool.free(seq.request_id)


@dataclass
class DecodeGrant:
    decodes: list[Sequence] = field(default_factory=list)  # may decode this step
    preempted: list[Sequence] = field(default_factory=list)  # freed, to be recomputed
    out_of_room: list[Sequence] = field(default_factory=list)  # freed, to finish ("length")


def reset_for_recompute(seq: Sequence) -> None:
    """A preempted sequence forgets its KV; its tokens (prompt + generated) stay."""
    seq.num_computed = 0
    seq.num_blocks_registered = 0
    seq.status = Status.WAITING
    seq.num_preemptions += 1
