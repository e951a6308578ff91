"""Finding the TTFT-minimising partition by search over real measured runs (KV-Runahead §4.3).

The cost of a slice grows with its length and with the prefix it attends to,
so even slices leave early ranks idle; the best cut is found by measurement,
not a model. For p = 2 there is one boundary and TTFT is unimodal in it, so a
golden-section search (ternary search reusing one probe per step) narrows the
interval down to the minimum stride. For p > 2 the hierarchical grid search:
every increasing boundary vector on a coarse grid, then a grid of half the
stride around the best point, recursively, down to the minimum stride.

Both searches take ``measure(boundaries) -> seconds`` and cache what they
measured, so they are tested with synthetic costs and run against a real chain.
"""

from __future__ import annotations

import itertools
import math
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch

from baton.kv import DenseKV
from baton.model import CausalLM, prefill
from baton.runahead.break_even import break_even
from baton.runahead.local import LocalChain
from baton.runahead.partition import even_boundaries, fractions_of
from baton.runahead.table import PartitionTable, TableEntry

Measure = Callable[[list[int]], float]
GOLDEN = (math.sqrt(5) - 1) / 2


@dataclass
class SearchSettings:
    coarse_divisions: int = 8  # first grid stride = C / coarse_divisions
    min_stride: int = 32  # tokens: the search stops refining below this
    repeats: int = 1  # runs per probe; the fastest counts (noise from other jobs only adds)

    def __post_init__(self) -> None:
        if self.coarse_divisions < 2 or self.min_stride < 1 or self.repeats < 1:
            raise ValueError(f"search needs coarse_divisions >= 2, min_stride >= 1 and repeats >= 1, "
                             f"got {self.coarse_divisions}, {self.min_stride}, {self.repeats}")


class CachedMeasure:
    """Measures each partition once and remembers the best one seen."""

    def __init__(self, measure: Measure) -> None:
        self.measure = measure
        self.seen: dict[tuple[int, ...], float] = {}

    def __call__(self, boundaries: Iterable[int]) -> float:
        key = tuple(boundaries)
        if key not in self.seen:
            self.seen[key] = self.measure(list(key))
        return self.seen[key]

    def best(self) -> tuple[list[int], float]:
        key = min(self.seen, key=self.seen.__getitem__)
        return list(key), self.seen[key]


def search_two_ranks(measure: Measure, context_length: int, settings: SearchSettings):
    """Golden-section search over b_1 in [1, C-1]; returns (boundaries, ttft_s)."""
    cached = CachedMeasure(measure)

    def at(b1: float) -> float:
        return cached([0, min(max(round(b1), 1), context_length - 1), context_length])

    low, high = 1.0, float(context_length - 1)
    left, right = high - GOLDEN * (high - low), low + GOLDEN * (high - low)
    left_cost, right_cost = at(left), at(right)
    while high - low > settings.min_stride:
        if left_cost <= right_cost:
            high, right, right_cost = right, left, left_cost
            left = high - GOLDEN * (high - low)
            left_cost = at(left)
        else:
            low, left, left_cost = left, right, right_cost
            right = low + GOLDEN * (high - low)
            right_cost = at(right)
    at(even_boundaries(context_length, 2)[1])  # the even cut is always a candidate
    return cached.best()


def _grid(center: list[int] | None, stride: int, span: int, context_length: int,
          num_ranks: int) -> Iterable[list[int]]:
    """Increasing interior boundaries on a ``stride`` grid, within ``span`` of ``center``."""
    if center is None:
        axes = [range(stride, context_length, stride)] * (num_ranks - 1)
    else:
        axes = [range(max(1, b - span), min(context_length - 1, b + span) + 1, stride)
                for b in center[1:-1]]
    for interior in itertools.product(*axes):
        if all(a < b for a, b in itertools.pairwise(interior)):
            yield [0, *interior, context_length]


def search_grid(measure: Measure, context_length: int, num_ranks: int, settings: SearchSettings):
    """Hierarchical grid search over p-1 boundaries; returns (boundaries, ttft_s)."""
    cached = CachedMeasure(measure)
    cached(even_boundaries(context_length, num_ranks))
    stride = max(1, context_length // settings.coarse_divisions)
    center = None
    while True:
        for boundaries in _grid(center, stride, 2 * stride, context_length, num_ranks):
            cached(boundaries)
        center, _ = cached.best()
        if stride <= settings.min_stride:
            return cached.best()
        stride = max(settings.min_stride, stride // 2)


def search(measure: Measure, context_length: int, num_ranks: int, settings: SearchSettings):
    if num_ranks == 2:
        return search_two_ranks(measure, context_length, settings)
    return search_grid(measure, context_length, num_ranks, settings)


# --- against real runs ---------------------------------------------------------------------


def chain_measure(chain: LocalChain, token_ids: torch.Tensor, repeats: int,
                  on_probe: Callable[[list[int], float], None] | None = None) -> Measure:
    """TTFT of the chain (rank 0 receiving the request -> tail holding the logits)."""

    def measure(boundaries: list[int]) -> float:
        ttft_s = min(chain.prefill(token_ids, boundaries, return_kv=False).ttft_s
                     for _ in range(repeats))
        if on_probe is not None:
            on_probe(boundaries, ttft_s)
        return ttft_s

    return measure


def single_process_ttft(model: CausalLM, token_ids: torch.Tensor, threads: int, repeats: int) -> float:
    """One process's prefill with ``threads`` intra-op threads (the chain's p=1 alternative)."""
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        times = []
        for _ in range(repeats):
            started = time.perf_counter()
            prefill(model, token_ids, torch.arange(token_ids.shape[0]),
                    DenseKV(model.config.num_hidden_layers))
            times.append(time.perf_counter() - started)
        return min(times)
    finally:
        torch.set_num_threads(previous)


def tune(chain: LocalChain, model: CausalLM, lengths: list[int], settings: SearchSettings,
         table: PartitionTable, progress=None,
         on_entry: Callable[[PartitionTable], None] | None = None) -> PartitionTable:
    """Measure and search every length on ``chain``; fills ``table`` (entries and min_context).

    ``on_entry`` sees the table after each length (the command saves it, so a long
    run that is stopped keeps what it measured).
    """
    num_ranks = chain.num_ranks
    generator = torch.Generator().manual_seed(0)

    def report(boundaries: list[int], ttft_s: float) -> None:
        if progress is not None:
            progress.set_postfix_str(f"C={boundaries[-1]} b={boundaries[1:-1]} {ttft_s:.3f}s")

    for context_length in lengths:
        token_ids = torch.randint(0, model.config.vocab_size, (context_length,), generator=generator)
        chain.prefill(token_ids, return_kv=False)  # warm the ranks' allocators for this size
        measure = chain_measure(chain, token_ids, settings.repeats, report)
        boundaries, ttft_s = search(measure, context_length, num_ranks, settings)
        table.put(TableEntry(
            num_ranks, context_length, [round(f, 4) for f in fractions_of(boundaries)], ttft_s,
            ttft_even_s=measure(even_boundaries(context_length, num_ranks)),
            ttft_single_s=single_process_ttft(model, token_ids, num_ranks, settings.repeats)))
        table.min_context[num_ranks] = crossover(table, num_ranks)
        if on_entry is not None:
            on_entry(table)
        if progress is not None:
            progress.update(1)
    return table


def crossover(table: PartitionTable, num_ranks: int) -> int:
    """Smallest measured C from which on the chain's compute beats one process at every
    measured length (twice the longest measured when it never does): ``break_even`` with
    nothing for the KV's transfer."""
    return break_even(table.points(num_ranks))
