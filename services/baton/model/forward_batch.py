"""What one forward takes: a flat batch of N tokens from several sequences, cut into
``Segment``-s (each a run of one sequence's tokens, with its ``SequenceKV``) and a
``DecodeBatch`` (one new token each for B sequences in a paged pool), and how its attention
is split among them (``AttentionPlan``): every segment on its own against its cache, the
decode batch group by group. The model's layers are ``baton.model.layers``; the forward
that runs them, ``baton.model.llama``.
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Protocol

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from baton.kernels import cpu as cpu_kernels
from baton.kernels import flex_decode
from baton.kv.decode_step import DecodeGroup, DecodeStep
from baton.model.attention import attend, attend_decode_batch, decode_attention_bias
from baton.model.sharding import HeadGather


class SequenceKV(Protocol):
    """The KV cache of one sequence, as the model sees it during a forward."""

    def extend(self, layer: int, k: torch.Tensor, v: torch.Tensor,
               positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Store layer ``layer``'s new k, v ([T, Hkv, D]) at ``positions`` ([T]) and return
        (keys [S, Hkv, D], values, key_positions [S]): the cached prefix, then the new ones."""
        ...


class AttentionObserver(Protocol):
    """Sees every layer's queries and keys of one segment (PyramidInfer scores a prompt
    with it)."""

    def observe(self, layer: int, q: torch.Tensor, query_positions: torch.Tensor,
                k: torch.Tensor, key_positions: torch.Tensor) -> None:
        ...


class DecodeObserver(Protocol):
    """Sees a generated token's queries, every layer's at once, when the decode batch's
    forward has computed them (PyramidInfer's generation phase records them and scores
    later, from the pool; it needs no keys, so the batch reads the cache where it lies)."""

    def observe_decode(self, queries: torch.Tensor, position: int) -> None:
        """queries: [layers, H, D] of the token at ``position``."""
        ...


@dataclass
class Segment:
    """``length`` consecutive tokens of the flat batch that belong to one sequence."""

    length: int
    kv: SequenceKV
    observer: AttentionObserver | None = None


@dataclass
class DecodeBatch:
    """The last B rows of the flat batch: one new token for each of B sequences whose KV
    lies in a paged pool. The caller (a runner) builds ``step`` with ``KVPool.begin_decode``;
    the model writes and reads the cache through it. ``observers[b]`` sees row b's queries.
    With ``record_queries`` the forward leaves every row's queries of every layer in
    ``queries`` ([B, layers, H, D]) instead: a CUDA graph's replay hands them to the observers
    after the fact, since calling them is host work a graph cannot hold. ``replayed``: the
    forward is being captured into a graph."""

    step: DecodeStep
    observers: Sequence[DecodeObserver | None] = ()
    record_queries: bool = False
    queries: torch.Tensor | None = None
    # Captured into a CUDA graph: there attention reads the cache in place through
    # FlexAttention, whose compiled call costs host time on every layer that only a replay hides.
    replayed: bool = False

    @property
    def size(self) -> int:
        return self.step.slots.shape[1]


# On CUDA, PyTorch may pick cuDNN's attention for a masked call, and cuDNN builds an
# execution plan for every new shape (milliseconds each). A decode batch's padded
# key span grows by a block every few steps, so that cost would recur all through
# generation; flash and memory-efficient attention have no per-shape setup.
_GPU_ATTENTION_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION,
                           SDPBackend.MATH]


def attention_kernels(device: torch.device):
    return sdpa_kernel(_GPU_ATTENTION_BACKENDS) if device.type == "cuda" else nullcontext()


class AttentionPlan:
    """How one forward's attention is split: every segment on its own against its
    ``SequenceKV``; the decode batch (if any) group by group, each group of sequences of
    similar length in one padded kernel call."""

    def __init__(self, segments: Sequence[Segment], decode: DecodeBatch | None,
                 num_rows: int, num_layers: int, head_gather: HeadGather | None = None) -> None:
        """``head_gather``: a tensor-parallel rank's, so that observers see every head."""
        self.head_gather = head_gather
        self.segments: list[tuple[int, Segment]] = []
        row = 0
        for segment in segments:
            self.segments.append((row, segment))
            row += segment.length
        self.decode = decode
        self.num_layers = num_layers
        self.observed = False  # are the decode batch's queries observed
        self.keeps_queries = False  # observed, or recorded for later (DecodeBatch.record_queries)
        if decode is not None:
            self.decode_rows = slice(row, num_rows)
            self.observed = any(observer is not None for observer in decode.observers)
            self.keeps_queries = self.observed or decode.record_queries
            self.in_place = False  # read the cache where it lies (set by the model)
            self._biases: dict[int, torch.Tensor] = {}  # per group, shared by same-shape layers
            self._decode_queries: list[torch.Tensor] = []  # each layer's, while observed

    def attend(self, layer: int, q, k, v, positions, sliding_window,
               rows: Sequence[int] | None = None, softcap: float | None = None) -> torch.Tensor:
        """Every row's k, v go to its cache; returns [N, H, D], the attention output of every
        row, or (given ``rows``) of the decode batch and of each segment from its first row
        among ``rows`` to its end (other rows are left unset)."""
        out = torch.empty_like(q)
        for row, segment in self.segments:
            end = row + segment.length
            k_all, v_all, key_positions = segment.kv.extend(layer, k[row:end], v[row:end],
                                                            positions[row:end])
            if segment.observer is not None:
                q_seen, k_seen = q[row:end], k_all
                if self.head_gather is not None:
                    q_seen, k_seen = self.head_gather.queries(q_seen), self.head_gather.keys(k_seen)
                segment.observer.observe(layer, q_seen, positions[row:end], k_seen, key_positions)
            first = row
            if rows is not None:  # from this segment's first wanted row on (usually its last)
                inside = [r for r in rows if row <= r < end]
                if not inside:
                    continue
                first = min(inside)  # to the end: attend() takes the segment's last queries
            out[first:end] = attend(q[first:end], k_all, v_all, positions[first:end],
                                    key_positions, sliding_window, softcap)
        if self.decode is not None:
            self._attend_decode(layer, q, k, v, positions, sliding_window, softcap, out)
        return out

    def _attend_decode(self, layer, q, k, v, positions, sliding_window, softcap, out) -> None:
        rows, step = self.decode_rows, self.decode.step
        step.write(layer, k[rows], v[rows], positions[rows])
        q, positions, out = q[rows], positions[rows], out[rows]  # views of the decode rows
        for index, group in enumerate(step.groups):
            self._attend_group(index, group, layer, q, positions, sliding_window, softcap, out)
        if self.keeps_queries:
            self._decode_queries.append(q)
            if layer == self.num_layers - 1:
                queries = torch.stack(self._decode_queries, dim=1)  # [B, layers, H, D]
                if self.head_gather is not None:
                    queries = self.head_gather.queries(queries)
                if self.decode.record_queries:
                    self.decode.queries = queries
                if self.observed:
                    observe_decode(self.decode.observers, queries, positions.tolist())

    def _attend_group(self, index: int, group: DecodeGroup, layer: int, q, positions,
                      sliding_window, softcap, out) -> None:
        rows, step = group.rows, self.decode.step
        if self.in_place:
            out[rows] = read_in_place(q[rows], step, group.blocks[layer], group.lengths[layer])
            return
        k_pad, v_pad, key_positions, lengths = step.read(
            group, layer, with_positions=sliding_window is not None, dtype=q.dtype)
        bias = self._biases.get(index)
        if bias is None or not group.uniform or sliding_window is not None:
            bias = decode_attention_bias(positions[rows], key_positions, lengths, k_pad.shape[1],
                                         sliding_window, q.dtype)
            if sliding_window is None:  # a windowed bias is its layer's alone (Gemma alternates)
                self._biases[index] = bias
        out[rows] = attend_decode_batch(q[rows], k_pad, v_pad, bias, softcap)


def read_in_place(q: torch.Tensor, step: DecodeStep, blocks: torch.Tensor,
                  lengths: torch.Tensor) -> torch.Tensor:
    """Decode attention of q [n, H, D] over the pool's blocks where they lie: baton's CPU
    kernel, or FlexAttention's on CUDA (``baton.kernels.flex_decode``)."""
    if q.device.type == "cuda":
        return flex_decode.reader_for(step.k_cache)(q, step.k_cache, step.v_cache, blocks, lengths)
    return cpu_kernels.kernels().paged_decode_attention(q.contiguous(), step.k_cache,
                                                        step.v_cache, blocks, lengths)


def observe_decode(observers: Sequence[DecodeObserver | None], queries: torch.Tensor,
                   positions: Sequence[int]) -> None:
    """Each observer gets its row's queries of every layer (queries: [B, layers, H, D]): one
    call per sequence, none per sequence and layer."""
    for observer, query, position in zip(observers, queries.unbind(0), positions):
        if observer is not None:
            observer.observe_decode(query, position)
