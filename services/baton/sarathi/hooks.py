"""The seam where KV compression (baton.pyramid) plugs into the engine.

The engine takes an optional ``CompressorFactory``; None turns compression
off. For each sequence it asks the factory for a ``SequenceCompressor``
(which may be None for that request, e.g. a per-request override):

* while a prompt is prefilled locally, the compressor is the attention
  observer of every chunk's ``Segment`` (it sees each layer's queries and keys),
  and on each decode step the decode batch's observer of its row (its queries);
* after the final chunk, the engine gathers the sequence's KV from the pool,
  calls ``compress(layers)`` and stores the (pyramid-shaped) result instead;
* after every decode step of the sequence, ``after_decode(pool, seq_id)`` runs
  the generation-phase update (it may prune with ``KVPool.retain``).

A sequence gets its compressor when it arrives and a fresh one when it is
preempted (its recompute starts over): ``attach_compressor``, over the request's own prompt;
the tokens it generated before (on another pod, or here before the preemption) are then
replayed through decode steps (``Sequence.replays_generated``), so the cache it rebuilds is
the one it had.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import torch

from baton.kv.dense import LayerKV
from baton.kv.pool import KVPool
from baton.sampling.params import SamplingParams
from baton.sarathi.request import Sequence


class SequenceCompressor(Protocol):
    def observe(self, layer: int, q: torch.Tensor, query_positions: torch.Tensor,
                k: torch.Tensor, key_positions: torch.Tensor) -> None:
        """One layer of one prefill chunk: q [T, H, D], k [S, Hkv, D] (all keys attended)."""
        ...

    def observe_decode(self, queries: torch.Tensor, position: int) -> None:
        """One decode step of the sequence: its token's queries of every layer [L, H, D]."""
        ...

    def cacheable_tokens(self) -> int:
        """How many of the prompt's first tokens may come from the prefix cache without
        changing what ``compress`` keeps (their queries need not pass ``observe``)."""
        ...

    def compress(self, layers: list[LayerKV]) -> list[LayerKV]:
        """The full prompt cache (one LayerKV per layer) -> the cache to keep."""
        ...

    def after_decode(self, pool: KVPool, seq_id: str) -> None:
        """Generation phase: called after each decode step of the sequence."""
        ...


# (token ids of the sequence, its sampling params) -> a compressor, or None for no compression.
CompressorFactory = Callable[[list[int], SamplingParams], SequenceCompressor | None]


def attach_compressor(factory: CompressorFactory | None, seq: Sequence) -> None:
    """Give ``seq`` its compressor (None: the engine or the request compresses nothing), over
    its own prompt; with one, its tokens generated before are replayed through decode steps."""
    own_prompt = seq.prompt_ids[:seq.own_prompt_length]
    seq.compressor = None if factory is None else factory(own_prompt, seq.params)
    seq.replays_generated = seq.compressor is not None


def compress_prompt(pool: KVPool, seq: Sequence) -> int:
    """Compress a freshly prefilled prompt in the pool; the KV entries kept (all layers)."""
    layers = [pool.gather(seq.request_id, layer) for layer in range(pool.num_layers)]
    kept = seq.compressor.compress(layers)
    pool.free(seq.request_id)
    pool.store(seq.request_id, kept)
    return sum(layer.num_tokens for layer in kept)
