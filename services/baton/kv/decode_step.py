"""A decode step's attention metadata: what the runner builds and the model consumes.

Design (after vLLM v1's model runner): ``KVPool.begin_decode`` claims room for one
new token per sequence in every layer and returns a ``DecodeStep`` — the flat slots
the new tokens go to, every layer's lengths and block tables, and the cache tensors
they index. The model writes and reads through the step and never touches the
pool's allocator.
The pool's methods that build a step (``DecodeSteps``: ``claim_decode`` claims the room
in host lists, ``decode_step`` turns a claim into tensors) live here, beside what they
build; ``KVPool`` inherits them.

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

from baton.host_to_device import to_device
from baton.kv.storage import KVStorage, copy_rows

# What one more group costs (its gathers, mask and kernel call per layer), in bytes of
# padding it saves (measured: docs/runtime-log.md).
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
    storage: KVStorage | None = None  # what the caches hold (None: the compute dtype)

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor) -> None:
        """Store one layer's new tokens (k, v: [B, Hkv, D]; positions [B])."""
        index = self.slots[layer]
        if self.storage is not None:
            k, v = self.storage.store(k), self.storage.store(v)
        copy_rows(self.k_cache.view(-1, *self.k_cache.shape[2:]), index, k)
        copy_rows(self.v_cache.view(-1, *self.v_cache.shape[2:]), index, v)
        self.positions.view(-1).index_copy_(0, index, positions)

    def read(self, group: DecodeGroup, layer: int, with_positions: bool = True,
             dtype: torch.dtype | None = None):
        """One layer of a group, padded to its widest: k, v [n, S, Hkv, D] (in ``dtype``, the
        compute dtype, when the caches hold another), positions [n, S] (None unless
        ``with_positions``) and lengths [n]. Rows past a sequence's length hold stale data:
        mask them."""
        index = group.blocks[layer]
        count, span = index.shape[0], index.shape[1] * self.k_cache.shape[1]
        flat = index.reshape(-1)
        k = self.k_cache.index_select(0, flat).view(count, span, *self.k_cache.shape[2:])
        v = self.v_cache.index_select(0, flat).view(count, span, *self.v_cache.shape[2:])
        if self.storage is not None and dtype is not None:
            k, v = self.storage.load(k, dtype), self.storage.load(v, dtype)
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
    sequences gained (a few per step at batch 64, where rebuilding meant thousands of ints). For
    CPU tensors only (a GPU may still be reading the last step's table)."""

    def __init__(self, seq_ids: list[str], per_sequence: list[list], num_layers: int) -> None:
        self.seq_ids = list(seq_ids)
        self.rows = {seq_id: row for row, seq_id in enumerate(seq_ids)}
        self.counts = [[len(tables[layer].blocks) for tables in per_sequence]
                       for layer in range(num_layers)]
        self.tensors = []
        for layer, counts in enumerate(self.counts):
            width = max(counts, default=0) + SPARE_BLOCKS
            # one tensor from padded lists: a tensor per row costs a Python call each
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


@dataclass
class ClaimedDecode:
    """A decode step's claim (``KVPool.claim_decode``), layer-major like ``DecodeStep``:
    slots[layer * B + b] is where sequence b's new token goes in that layer, lengths[...] how
    many tokens that layer then holds, blocks[b][layer] its block table (the pool's own list:
    read it, do not keep it)."""

    seq_ids: list[str]
    slots: list[int]
    lengths: list[int]
    blocks: list[list[list[int]]]


class DecodeSteps:
    """``KVPool``'s decode-step half (a mixin: the pool's block tables, cache tensors and
    allocator are its own): claim room for one new token per sequence, and describe the step
    to the model as a ``DecodeStep``."""

    def _init_decode_steps(self) -> None:
        # The last ungrouped decode batch's block tables (see BatchTables); dropped whenever
        # blocks are taken from a sequence, which appending alone never does.
        self._batch: BatchTables | None = None

    def begin_decode(self, seq_ids: list[str], grouped: bool = True) -> DecodeStep:
        """Claim room for one new token per sequence in every layer; return the step's metadata.

        The batched form of ``append`` for decode steps: the block tables are walked once
        per step rather than once per layer, and every index reaches the device in one copy
        (on a GPU each separate copy costs a launch, and Python time per layer and sequence
        adds up at batch 32). Lengths count the new token from here on; the model then
        writes each layer's token with ``DecodeStep.write`` and reads with ``DecodeStep.read``.
        Sequences are attended in groups of similar width (see ``baton.kv.decode_step``);
        ``grouped=False`` makes them one group, for a reader that takes the blocks where they
        lie and so pays nothing for padding (the CPU decode kernel).
        A sequence that needs a block and cannot get one raises ``KVPoolExhausted`` before
        any of its layers changed.
        """
        return self.decode_step(self.claim_decode(seq_ids), grouped)

    def claim_decode(self, seq_ids: list[str]) -> ClaimedDecode:
        """``begin_decode``'s first half: room for one new token per sequence in every layer,
        described in host lists (a CUDA graph's replay copies them into its own tensors)."""
        size = self.block_size
        for seq_id in seq_ids:
            tables = self._tables.get(seq_id)
            if tables is None or any(table.length == len(table.blocks) * size for table in tables):
                self.reserve(seq_id, 1)
        per_sequence = [self._tables[seq_id] for seq_id in seq_ids]
        slots: list[int] = []
        lengths: list[int] = []
        for layer in range(self.num_layers):
            for tables in per_sequence:
                table = tables[layer]
                slots.append(table.blocks[table.length // size] * size + table.length % size)
                table.length += 1
                lengths.append(table.length)
        return ClaimedDecode(list(seq_ids), slots, lengths,
                             [[table.blocks for table in tables] for tables in per_sequence])

    def decode_step(self, claimed: ClaimedDecode, grouped: bool = True) -> DecodeStep:
        """``begin_decode``'s second half: the claimed step's tensors, on the pool's device."""
        seq_ids, slots, lengths = claimed.seq_ids, claimed.slots, claimed.lengths
        per_sequence = [self._tables[seq_id] for seq_id in seq_ids]
        batch, per_layer = len(seq_ids), self.num_layers * len(seq_ids)
        if not grouped and seq_ids and self.k_cache.device.type == "cpu":
            return self._ungrouped_step(seq_ids, per_sequence, slots, lengths)
        widths = [max(len(table.blocks) for table in tables) for tables in per_sequence]
        rows = group_by_width(widths, max(1, GROUP_OVERHEAD_BYTES // self.bytes_per_block))
        if not grouped and seq_ids:
            rows = [slice(0, batch)]
        blocks: list[int] = []
        shapes: list[tuple[int, int]] = []  # (sequences, width) of each group's layer table
        for group in rows:
            for layer in range(self.num_layers):
                tables = [tables[layer] for tables in per_sequence[group]]
                width = max(len(table.blocks) for table in tables)
                for table in tables:
                    blocks += table.blocks
                    blocks += [0] * (width - len(table.blocks))
                shapes.append((len(tables), width))
        flat = to_device(slots + lengths + blocks, self.k_cache.device)
        all_lengths = flat[per_layer:2 * per_layer].view(self.num_layers, batch)
        tables = iter(flat[2 * per_layer:].split([n * width for n, width in shapes]))
        shapes_of = iter(shapes)
        groups = []
        for group in rows:
            layer_blocks = [next(tables).view(*next(shapes_of)) for _ in range(self.num_layers)]
            group_lengths = [lengths[layer * batch + group.start:layer * batch + group.stop]
                             for layer in range(self.num_layers)]
            uniform = (len({table.shape[1] for table in layer_blocks}) == 1
                       and all(row == group_lengths[0] for row in group_lengths))
            groups.append(DecodeGroup(group, layer_blocks, all_lengths[:, group], uniform))
        return DecodeStep(flat[:per_layer].view(self.num_layers, batch), groups,
                          self.k_cache, self.v_cache, self.positions, self.storage)

    def _ungrouped_step(self, seq_ids: list[str], per_sequence: list, slots: list[int],
                        lengths: list[int]) -> DecodeStep:
        """A CPU decode step as one group, its block tables kept from the last step."""
        if self._batch is None or not self._batch.patch(seq_ids, per_sequence):
            self._batch = BatchTables(seq_ids, per_sequence, self.num_layers)
        batch = len(seq_ids)
        flat = to_device(slots + lengths, "cpu")
        all_lengths = flat[len(slots):].view(self.num_layers, batch)
        group = DecodeGroup(slice(0, batch), list(self._batch.tensors), all_lengths, uniform=False)
        return DecodeStep(flat[:len(slots)].view(self.num_layers, batch), [group],
                          self.k_cache, self.v_cache, self.positions, self.storage)
