"""KV memory for the scheduler: admission, per-step reservation, preemption.

Design: the policy decides *what* runs; this module decides whether the pool
can hold it. A request is admitted only when the pool can hold KV for all of
its uncomputed tokens, and those blocks are claimed at admission, so a
chunked prefill never runs dry half way. Each decode claims its one new slot
before the step (``KVPool.reserve``: all layers or none); when the pool is
full the newest sequence is preempted — its blocks freed, its generated
tokens kept for a recompute later — so running out is never an
out-of-memory crash.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from baton.config import KVPoolConfig
from baton.kv.pool import KVPool, KVPoolExhausted
from baton.model.config import ModelConfig
from baton.sarathi.request import Sequence, Status


def build_pool(model_config: ModelConfig, config: KVPoolConfig, dtype: torch.dtype,
               device: torch.device | str = "cpu") -> KVPool:
    """A pool sized by ``config``: ``num_blocks`` or, when 0, as many as fit ``memory_mib``."""
    num_layers = model_config.num_hidden_layers
    num_blocks = config.num_blocks
    if num_blocks == 0:
        element_size = torch.empty(0, dtype=dtype).element_size()
        bytes_per_block = (2 * config.block_size * model_config.num_key_value_heads
                           * model_config.head_dim * element_size)
        num_blocks = config.memory_mib * 2**20 // bytes_per_block
        if num_blocks < num_layers:
            raise ValueError(f"kv memory_mib {config.memory_mib} holds {num_blocks} blocks, fewer "
                             f"than one per layer ({num_layers}); raise memory_mib")
    return KVPool(num_layers, model_config.num_key_value_heads, model_config.head_dim,
                  config.block_size, num_blocks, dtype=dtype, device=device)


class KVManager:
    def __init__(self, pool: KVPool) -> None:
        self.pool = pool

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
        else:
            needed = self.pool.blocks_needed(seq.request_id, seq.num_uncomputed)
        if needed + headroom_blocks > self.pool.num_free_blocks:
            return False
        if seq.arrived_kv is not None:
            self.pool.store(seq.request_id, seq.arrived_kv)
            seq.arrived_kv = None
        else:
            self.pool.reserve(seq.request_id, seq.num_uncomputed)
        return True

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
    seq.status = Status.WAITING
    seq.num_preemptions += 1
