"""A decode step's attention metadata: what the runner builds and the model consumes.

Design (after vLLM v1's model runner): ``KVPool.begin_decode`` claims room for one
new token per sequence in every layer and returns a ``DecodeStep`` — the flat slots
the new tokens go to, every layer's lengths and block tables, and the cache tensors
they index. The model writes and reads through the step and never touches the
pool's allocator.

Reading a decode batch gathers each sequence's blocks into a padded tensor for one
kernel call; a batch of ragged lengths (50 to 900 tokens) padded to its longest
reads up to twice the bytes it needs, twice (the gather, then attention). So the
sequences are cut into *groups* of similar width, each gathered and attended on its
own: a group costs a few more kernel calls, worth ``GROUP_OVERHEAD_BYTES`` of
padding, and a new group starts where extending the current one would pad more than
that. Given sequences sorted by length (the runner sorts them) the groups are the
quantiles that matter; in any order they stay correct, only wider.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

# What one more group costs (its gathers, mask and kernel call per layer), in bytes of
# padding it saves: on the development CPUs a group's fixed cost is ~50 µs and a byte of
# K/V costs ~0.2 ns to gather and attend.
GROUP_OVERHEAD_BYTES = 256 * 1024


@dataclass
class DecodeGroup:
    """Consecutive sequences of a step (``rows``), attended together."""

    rows: slice
    blocks: list[torch.Tensor]  # per layer: [n, W_l] block ids, padded with block 0
    lengths: torch.Tensor  # [layers, n] tokens per layer, counting the new one
    uniform: bool  # every layer has the same lengths and widths (nothing pruned)


@dataclass
class DecodeStep:
    """One decode step of B sequences over every layer. slots[l, b]: the flat slot
    (block * block_size + offset) of sequence b's new token in layer l."""

    slots: torch.Tensor
    groups: list[DecodeGroup]
    k_cache: torch.Tensor  # [num_blocks, block_size, Hkv, D], the pool's storage
    v_cache: torch.Tensor
    positions: torch.Tensor  # [num_blocks, block_size]

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor) -> None:
        """Store one layer's new tokens (k, v: [B, Hkv, D]; positions [B])."""
        index = self.slots[layer]
        self.k_cache.view(-1, *self.k_cache.shape[2:]).index_copy_(0, index, k)
        self.v_cache.view(-1, *self.v_cache.shape[2:]).index_copy_(0, index, v)
        self.positions.view(-1).index_copy_(0, index, positions)

    def read(self, group: DecodeGroup, layer: int, with_positions: bool = True):
        """One layer of a group, padded to its widest: k, v [n, S, Hkv, D], positions [n, S]
        (None unless ``with_positions``) and lengths [n]. Rows past a sequence's length
        hold stale data: mask them."""
        index = group.blocks[layer]
        count, span = index.shape[0], index.shape[1] * self.k_cache.shape[1]
        flat = index.reshape(-1)
        k = self.k_cache.index_select(0, flat).view(count, span, *self.k_cache.shape[2:])
        v = self.v_cache.index_select(0, flat).view(count, span, *self.v_cache.shape[2:])
        positions = (self.positions.index_select(0, flat).view(count, span)
                     if with_positions else None)
        return k, v, positions, group.lengths[layer]


def group_by_width(widths: list[int], max_padding_blocks: int) -> list[slice]:
    """Cut a run of sequences (``widths``: blocks each) into consecutive groups; a new group
    starts where keeping the current one would add more than ``max_padding_blocks`` of
    padding (every member pads to the group's widest)."""
    groups: list[slice] = []
    start, width = 0, widths[0] if widths else 0
    for index in range(1, len(widths)):
        grown = max(width, widths[index])
        added = (grown - width) * (index - start) + (grown - widths[index])
        if added > max_padding_blocks:
            groups.append(slice(start, index))
            start, width = index, widths[index]
        else:
            width = grown
    if widths:
        groups.append(slice(start, len(widths)))
    return groups


# Rows of a batch's block table get this many spare columns, so that a sequence's next
# blocks fit without building the table anew.
SPARE_BLOCKS = 4


class BatchTables:
    """The block tables of one ungrouped decode batch, kept between steps and patched in
    place: while the batch holds the same sequences, a step only writes the blocks that
    sequences gained (a few per step at batch 64, where rebuilding meant ~10k ints). For
    CPU tensors only (a GPU may still be reading the last step's table)."""

    def __init__(self, seq_ids: list[str], per_sequence: list[list], num_layers: int) -> None:
        self.seq_ids = list(seq_ids)
        self.rows = {seq_id: row for row, seq_id in enumerate(seq_ids)}
        self.counts = [[len(tables[layer].blocks) for tables in per_sequence]
                       for layer in range(num_layers)]
        self.tensors = []
        for layer, counts in enumerate(self.counts):
            width = max(counts, default=0) + SPARE_BLOCKS
            # one tensor from padded lists: a tensor per row cost ~9 ms a step at batch 256
            rows = [tables[layer].blocks + [0] * (width - len(tables[layer].blocks))
                    for tables in per_sequence]
            self.tensors.append(torch.tensor(rows, dtype=torch.long).view(len(seq_ids), width))

    def truncate(self, seq_id: str, layer: int, count: int) -> None:
        """A sequence's layer now holds only its first ``count`` blocks (PyramidInfer pruned
        it): blocks it gains later are written from there."""
        row = self.rows.get(seq_id)
        if row is not None:
            self.counts[layer][row] = min(self.counts[layer][row], count)

    def patch(self, seq_ids: list[str], per_sequence: list[list]) -> bool:
        """Bring the tables up to date with the sequences' blocks; False when they no longer
        describe this batch (other sequences, or a row that outgrew its spare columns)."""
        if seq_ids != self.seq_ids:
            return False
        for layer, (counts, table) in enumerate(zip(self.counts, self.tensors, strict=True)):
            for row, tables in enumerate(per_sequence):
                blocks = tables[layer].blocks
                known = counts[row]
                if len(blocks) != known:
                    if len(blocks) < known or len(blocks) > table.shape[1]:
                        return False
                    table[row, known:len(blocks)] = torch.tensor(blocks[known:])
                    counts[row] = len(blocks)
        return True
