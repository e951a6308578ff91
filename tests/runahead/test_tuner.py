"""The partition searches against synthetic TTFT curves with a known minimum (no processes)."""

from __future__ import annotations

import itertools

import pytest
from baton.runahead import PartitionTable, TableEntry
from baton.runahead.tuner import SearchSettings, crossover, search_grid, search_two_ranks


def slice_costs(boundaries: list[int]) -> float:
    """A KV-Runahead-like cost: rank i's time grows with its tokens and the prefix they attend to;
    ranks run in parallel (layer by layer), so the slowest rank sets TTFT, plus the relay's cost."""
    work = [(end - start) * 1.0 + (end * end - start * start) * 1e-3
            for start, end in itertools.pairwise(boundaries)]
    return max(work) + 0.01 * sum(boundaries[1:-1])


def brute_force(context_length: int, num_ranks: int) -> float:
    if num_ranks == 2:
        return min(slice_costs([0, b, context_length]) for b in range(1, context_length))
    return min(slice_costs([0, a, b, context_length])
               for a in range(1, context_length) for b in range(a + 1, context_length))


def test_two_rank_search_lands_within_a_stride_of_the_optimum_in_few_probes():
    probes = []

    def measure(boundaries):
        probes.append(boundaries)
        return slice_costs(boundaries)

    boundaries, cost = search_two_ranks(measure, 2048, SearchSettings(min_stride=16))
    best = brute_force(2048, 2)
    assert cost <= best * 1.01
    assert boundaries[1] > 1024  # rank 0 has no prefix to attend to: it takes more tokens
    assert len(probes) < 25


def test_hierarchical_grid_search_for_three_ranks():
    probes = []

    def measure(boundaries):
        probes.append(boundaries)
        assert boundaries[0] == 0 < boundaries[1] < boundaries[2] < boundaries[3] == 300
        return slice_costs(boundaries)

    _boundaries, cost = search_grid(measure, 300, 3, SearchSettings(coarse_divisions=6, min_stride=4))
    assert cost <= brute_force(300, 3) * 1.02
    assert len(set(map(tuple, probes))) == len(probes)  # never measures a partition twice
    assert len(probes) < 300 * 299 / 2 / 10  # far fewer than exhaustive


def test_crossover_is_where_the_chain_starts_winning_for_good():
    table = PartitionTable("t")
    for length, chain_s, single_s in [(256, 2.0, 1.0), (512, 0.9, 1.0), (1024, 1.1, 1.0),
                                      (2048, 1.5, 2.0), (4096, 3.0, 5.0)]:
        table.put(TableEntry(2, length, [0.5, 1.0], chain_s, chain_s, single_s))
    assert crossover(table, 2) == 2048
    table.put(TableEntry(2, 4096, [0.5, 1.0], 6.0, 6.0, 5.0))
    assert crossover(table, 2) == 8192  # never wins at the longest: beyond what was measured


def test_bad_search_settings_are_rejected():
    with pytest.raises(ValueError, match="min_stride >= 1"):
        SearchSettings(min_stride=0)
