"""Decode-only iterations replayed from CUDA graphs: no kernel launch per operation.

Why: on a GPU an eager decode step is a few hundred small kernels, each launched from
Python; for a small or mid-sized model the launches, not the bytes of the weights, set
the step time (docs/runtime.md, "On a GPU"). A CUDA graph records a step's kernels once
and replays them with one launch.

How (after vLLM's model runner): a graph is captured for each (batch, width) bucket the
first time a step falls in it. The batch is rounded up to a power of two; the block-table
width (blocks of the longest row) up to the next of 1, 2, 3, 4, 6, 8, 12, 16, ..., so a
step reads at most 1.5x the blocks it needs. The graph runs the model's one forward, the
same code as on a CPU, over a ``DecodeStep`` whose tensors are static: token ids,
positions, slots, lengths and block tables lie in one device buffer per batch bucket,
which a replay refreshes with one pinned, non-blocking copy. Rows past the real batch
decode a dummy token whose K/V go to a block the pool sets aside
(``KVPool.scratch_block``); columns past a row's blocks point at block 0 and are masked by
the row's length. The logits and every layer's queries (PyramidInfer's generation phase
records them) are copied into static outputs; the observers are called after the replay,
since calling them is host work.

Where a graph cannot apply (an iteration with a prefill chunk, a batch or a context past
the largest bucket, a batch so ragged that padding it would read more than ``MAX_PADDING``
times its blocks, no free block for the scratch), the step runs eagerly; a capture that
fails turns graphs off for the process, with a warning naming the cause. On a CPU the
same static step runs without capture (``capture=False``): that is how the tests show
that a padded, replayed step computes what the eager step does.
"""

from __future__ import annotations

import itertools
import logging
from dataclasses import dataclass

import numpy as np
import torch

from baton.config import SchedulerConfig
from baton.kv.decode_step import ClaimedDecode, DecodeGroup, DecodeStep
from baton.kv.pool import KVPool, KVPoolExhausted
from baton.model.forward_batch import DecodeBatch, DecodeObserver, observe_decode
from baton.model.llama import CausalLM

log = logging.getLogger(__name__)


# A graph reads every row of its bucket padded to the bucket's width: at most this many
# times the blocks the step's rows hold (a uniform batch pads up to 2x in rows and 1.5x in
# width). Beyond that (a long sequence among short ones) the eager step, which cuts the
# batch into groups of similar width, reads far less than the launches a graph saves.
MAX_PADDING = 4


def batch_bucket(batch: int) -> int:
    """The graph batch a step of ``batch`` sequences runs in: the next power of two."""
    return 1 << (batch - 1).bit_length()


def width_bucket(width: int) -> int:
    """The block-table width a step whose longest row has ``width`` blocks runs in: the
    next of 1, 2, 3, 4, 6, 8, 12, 16, 24, ... (powers of two and 3/4 of each from 4 up)."""
    power = 1 << (width - 1).bit_length()
    return power * 3 // 4 if power >= 4 and width <= power * 3 // 4 else power


def width_buckets(max_width: int) -> list[int]:
    """Every width bucket up to ``max_width`` (itself a bucket)."""
    buckets = [1]
    while buckets[-1] < max_width:
        buckets.append(width_bucket(buckets[-1] + 1))
    return buckets


@dataclass
class _Buffers:
    """One batch bucket's static tensors, shared by its graphs of every width. ``inputs``
    holds, in order: token ids [B], positions [B], slots [L, B], lengths [L, B] and the
    block tables [L, B, W] of the width being replayed (up to the largest width)."""

    batch: int
    inputs: torch.Tensor  # int64, on the model's device
    staging: torch.Tensor  # int64 on the host (pinned on a GPU): the copy's source
    copied: torch.cuda.Event | None  # the last copy out of ``staging`` (GPU only)
    rows: torch.Tensor  # arange(B): every row's hidden state is wanted
    logits: torch.Tensor  # [B, vocab] fp32
    queries: torch.Tensor  # [B, layers, H, D]


class DecodeGraphs:
    """Runs decode-only steps of one model over one pool as replayed CUDA graphs.

    ``max_batch``: the largest batch replayed (larger ones run eagerly); ``max_context``:
    the longest sequence (tokens in its widest layer) replayed. ``capture``: record graphs
    (default: on a CUDA device); False runs the same static step eagerly."""

    def __init__(self, model: CausalLM, pool: KVPool,
                 max_batch: int = SchedulerConfig.cuda_graph_max_batch,
                 max_context: int = SchedulerConfig.cuda_graph_max_context,
                 capture: bool | None = None) -> None:
        self.model = model
        self.pool = pool
        self.max_batch = max_batch
        # no sequence outgrows the model's context
        context = min(max_context, model.config.max_position_embeddings)
        self.max_width = width_bucket(pool.blocks_for(context))
        self.capture = model.device.type == "cuda" if capture is None else capture
        self.enabled = True
        self.failure: str | None = None  # why capture failed, once it has (graphs are off)
        self.replayed_steps = 0  # steps this object ran (metrics, tests)
        self._buffers: dict[int, _Buffers] = {}
        self._graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}
        self._memory = None  # the graphs' shared memory pool, made at the first capture

    @property
    def num_graphs(self) -> int:
        return len(self._graphs)

    def fits(self, batch: int) -> bool:
        """Can a decode-only step of ``batch`` sequences be replayed (as far as its size says)?"""
        return self.enabled and 1 <= batch <= self.max_batch

    def run(self, claimed: ClaimedDecode, token_ids: list[int], positions: list[int],
            observers: list[DecodeObserver | None]) -> torch.Tensor | None:
        """Run a claimed decode step (``KVPool.claim_decode``, rows in the order of
        ``token_ids``); returns its logits [n, vocab] fp32 on the model's device, or None where
        no graph applies: the caller then runs the same claim eagerly."""
        count = len(claimed.seq_ids)
        widths = [max(len(blocks) for blocks in row) for row in claimed.blocks]
        widest = max(widths)
        if not self.fits(count) or widest > self.max_width:
            return None
        width = width_bucket(widest)  # at most max_width, itself a bucket
        if batch_bucket(count) * width > MAX_PADDING * sum(widths):
            return None  # ragged: the eager step's groups of similar width read far less
        try:
            scratch = self.pool.scratch_block()
        except KVPoolExhausted:
            return None
        buffers = self._buffers_for(batch_bucket(count))
        self._fill(buffers, claimed, token_ids, positions, scratch, width)
        if self.capture:
            graph = self._graphs.get((buffers.batch, width)) or self._record(buffers, width)
            if graph is None:
                return None
            graph.replay()
        else:
            self._forward(buffers, width)
        self.replayed_steps += 1
        if any(observer is not None for observer in observers):
            observe_decode(observers, buffers.queries[:count], positions)
        # a copy, on the device (cheap there): the static buffer is the next replay's
        return buffers.logits[:count].clone()

    def capture_all(self) -> int:
        """Capture every bucket's graph now (a decode pod does, before it serves): no step
        pays a capture later. Each runs its step once on padding alone, which writes only
        the scratch block. Returns the number of graphs; stops at a capture that fails."""
        if not self.capture or not self.enabled:
            return 0
        try:
            scratch = self.pool.scratch_block()
        except KVPoolExhausted:
            return 0
        nothing = ClaimedDecode([], [], [], [])
        for batch, width in self.buckets():
            if (batch, width) not in self._graphs:
                buffers = self._buffers_for(batch)
                self._fill(buffers, nothing, [], [], scratch, width)
                if self._record(buffers, width) is None:
                    break
        return self.num_graphs

    def buckets(self) -> list[tuple[int, int]]:
        """Every (batch, width) bucket a step over this pool can replay in."""
        # a step's rows hold at most the pool's blocks of one layer between them
        most_held = self.pool.num_blocks // self.model.config.num_hidden_layers
        batches = [1 << power for power in range(batch_bucket(self.max_batch).bit_length())]
        return [(batch, width) for batch in batches for width in width_buckets(self.max_width)
                if batch * width <= MAX_PADDING * most_held]

    # --- buffers --------------------------------------------------------------------------

    def _buffers_for(self, batch: int) -> _Buffers:
        buffers = self._buffers.get(batch)
        if buffers is None:
            buffers = self._buffers[batch] = self._allocate(batch)
        return buffers

    def _allocate(self, batch: int) -> _Buffers:
        config, device = self.model.config, self.model.device
        layers = config.num_hidden_layers
        size = 2 * batch + 2 * layers * batch + layers * batch * self.max_width
        on_gpu = device.type == "cuda"
        return _Buffers(
            batch=batch,
            inputs=torch.zeros(size, dtype=torch.int64, device=device),
            staging=torch.zeros(size, dtype=torch.int64, pin_memory=on_gpu),
            copied=torch.cuda.Event() if on_gpu else None,
            rows=torch.arange(batch, device=device),
            logits=torch.zeros(batch, config.vocab_size, dtype=torch.float32, device=device),
            queries=torch.zeros(batch, layers, config.num_attention_heads, config.head_dim,
                                dtype=self.model.dtype, device=device))

    def _fill(self, buffers: _Buffers, claimed: ClaimedDecode, token_ids: list[int],
              positions: list[int], scratch: int, width: int) -> None:
        """Write the step into the static inputs, padded to the bucket: one host buffer (filled
        with numpy, not Python lists, which cost a step's worth of time at batch 64), one copy
        to the device."""
        batch, count, layers = buffers.batch, len(claimed.seq_ids), self.model.config.num_hidden_layers
        if buffers.copied is not None:
            buffers.copied.synchronize()  # the last step's copy has read the staging buffer
        staged = buffers.staging.numpy()
        rows = staged[:2 * batch].reshape(2, batch)
        rows[0, :count], rows[1, :count] = token_ids, positions
        rows[:, count:] = 0  # a padded row's dummy token sits at position 0 ...
        start = 2 * batch
        slots = staged[start:start + layers * batch].reshape(layers, batch)
        slots[:, :count] = np.asarray(claimed.slots).reshape(layers, count)
        slots[:, count:] = scratch * self.pool.block_size  # ... in its scratch slot
        start += layers * batch
        lengths = staged[start:start + layers * batch].reshape(layers, batch)
        lengths[:, :count] = np.asarray(claimed.lengths).reshape(layers, count)
        lengths[:, count:] = 1  # and sees only itself
        start += layers * batch
        tables = staged[start:start + layers * batch * width].reshape(layers, batch, width)
        tables[...] = 0  # columns past a row's blocks: block 0, masked by its length
        tables[:, count:, 0] = scratch
        by_row = [row[layer] for layer in range(layers) for row in claimed.blocks]
        held = np.fromiter(map(len, by_row), dtype=np.int64, count=len(by_row))
        # in (layer, row, column) order, which is the order of the mask's True entries
        tables[:, :count][np.arange(width) < held.reshape(layers, count, 1)] = np.fromiter(
            itertools.chain.from_iterable(by_row), dtype=np.int64, count=int(held.sum()))
        size = start + layers * batch * width
        buffers.inputs[:size].copy_(buffers.staging[:size], non_blocking=True)
        if buffers.copied is not None:
            buffers.copied.record()

    # --- the step -------------------------------------------------------------------------

    def _forward(self, buffers: _Buffers, width: int) -> None:
        """The model's forward over the static inputs, into the static outputs."""
        batch, layers = buffers.batch, self.model.config.num_hidden_layers
        sizes = [batch, batch, layers * batch, layers * batch, layers * batch * width]
        token_ids, positions, slots, lengths, tables = buffers.inputs[:sum(sizes)].split(sizes)
        blocks = tables.view(layers, batch, width)
        group = DecodeGroup(slice(0, batch), list(blocks.unbind(0)), lengths.view(layers, batch),
                            uniform=False)
        pool = self.pool
        step = DecodeStep(slots.view(layers, batch), [group], pool.k_cache, pool.v_cache,
                          pool.positions, pool.storage)
        decode = DecodeBatch(step, record_queries=True, replayed=self.capture)
        hidden = self.model(token_ids, positions, [], buffers.rows, decode)
        buffers.logits.copy_(self.model.logits(hidden))
        buffers.queries.copy_(decode.queries)

    def _record(self, buffers: _Buffers, width: int) -> torch.cuda.CUDAGraph | None:
        """Capture the step of this bucket (its inputs already filled); None, and graphs off
        for good, where capture fails."""
        try:
            if self._memory is None:
                self._memory = torch.cuda.graph_pool_handle()
            # A warm-up run first, on a side stream as PyTorch asks (cuBLAS and attention set
            # up their workspaces outside the capture). It computes this very step: the K/V
            # it writes are the ones the replay writes again.
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                self._forward(buffers, width)
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self._memory, capture_error_mode="thread_local"):
                self._forward(buffers, width)
        except RuntimeError as error:
            log.warning("CUDA graphs are off for this process: capturing a decode step of batch "
                        "%d and width %d blocks failed (%s); decode steps run eagerly",
                        buffers.batch, width, error)
            self.enabled = False
            self.failure = f"batch {buffers.batch}, width {width}: {error}"
            return None
        self._graphs[(buffers.batch, width)] = graph
        return graph
