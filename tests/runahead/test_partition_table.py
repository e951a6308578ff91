"""Partitions, request validation and partition tables: everything decided before a rank starts."""

from __future__ import annotations

import json

import pytest
import torch
from baton.model.presets import PRESETS
from baton.runahead import LocalChain, ModelSource, PartitionTable, TableEntry, choose_chain_size
from baton.runahead.partition import (
    boundaries_from_fractions,
    even_boundaries,
    fractions_of,
    validate_boundaries,
)
from baton.runahead.request import make_request
from baton.runahead.table import DEFAULT_TABLE

CONFIG = PRESETS["random-50m"]


def test_even_boundaries_spread_the_remainder_and_never_starve_the_tail():
    assert even_boundaries(12, 3) == [0, 4, 8, 12]
    assert even_boundaries(10, 3) == [0, 3, 6, 10]
    assert even_boundaries(3, 4) == [0, 0, 1, 2, 3]  # C < p: rank 0 passes the cache on
    for length in range(1, 9):
        b = even_boundaries(length, 4)
        assert b[-2] < b[-1] == length


@pytest.mark.parametrize("boundaries, message", [
    ([0, 6, 4, 10], "decreases at rank 1"),
    ([0, 5, 10], "has 2 slices, the chain has 3 ranks"),
    ([1, 4, 6, 10], "must run from 0 to the prompt length 10"),
    ([0, 4, 6, 9], "must run from 0 to the prompt length 10"),
    ([0, 4, 10, 10], "leaves the tail (rank 2) no tokens"),
])
def test_bad_partitions_are_rejected_with_the_value(boundaries, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        validate_boundaries(boundaries, 3, 10)


def test_requests_are_validated_against_the_model():
    with pytest.raises(ValueError, match="prompt of 20000 tokens exceeds the model's limit of 16384"):
        make_request(0, torch.zeros(20000, dtype=torch.int64), 2, CONFIG)
    with pytest.raises(ValueError, match=r"prompt token ids \[32000\] are outside the vocabulary"):
        make_request(0, [1, 2, 32000], 2, CONFIG)
    with pytest.raises(ValueError, match="prompt is empty"):
        make_request(0, [], 2, CONFIG)
    with pytest.raises(ValueError, match="TSP runs even slices"):
        make_request(0, list(range(10)), 2, CONFIG, boundaries=[0, 7, 10], mode="tsp")
    with pytest.raises(ValueError, match="mode 'ring'"):
        make_request(0, list(range(10)), 2, CONFIG, mode="ring")
    request = make_request(3, list(range(10)), 3, CONFIG)
    assert request.boundaries == [0, 3, 6, 10] and request.token_ids.dtype == torch.int64


def _table() -> PartitionTable:
    table = PartitionTable("test", min_context={2: 1000, 3: 4000})
    table.put(TableEntry(2, 1000, [0.5, 1.0]))
    table.put(TableEntry(2, 3000, [0.7, 1.0]))
    table.put(TableEntry(3, 4000, [0.4, 0.7, 1.0]))
    return table


def test_table_interpolates_between_the_two_nearest_entries():
    table = _table()
    assert table.fractions(2, 2000) == pytest.approx([0.6, 1.0])
    assert table.fractions(2, 1500) == pytest.approx([0.55, 1.0])
    assert table.fractions(2, 500) == [0.5, 1.0]  # below the range: the nearest entry
    assert table.fractions(2, 9000) == [0.7, 1.0]
    assert table.boundaries(2, 2000) == [0, 1200, 2000]
    assert table.boundaries(3, 10) == [0, 4, 7, 10]


def test_fractions_round_trip_and_keep_the_tail_nonempty():
    assert fractions_of([0, 300, 1000]) == [0.3, 1.0]
    assert boundaries_from_fractions([0.3, 1.0], 1000) == [0, 300, 1000]
    assert boundaries_from_fractions([1.0, 1.0], 5) == [0, 4, 5]


def test_table_for_the_wrong_chain_size_is_rejected_before_any_rank_starts():
    table = _table()
    with pytest.raises(ValueError, match=r"entries for ranks \[2, 3\], not for a chain of 4"):
        table.fractions(4, 1000)
    with pytest.raises(ValueError, match="not for a chain of 5"):
        LocalChain(ModelSource(preset="random-50m"), 5, table=table)  # raises before spawning


def test_chain_size_rule_follows_the_measured_crossovers():
    table = _table()
    assert [table.chain_size(c, max_ranks=4) for c in (10, 999, 1000, 3999, 4000)] == [1, 1, 2, 2, 3]
    assert table.chain_size(5000, max_ranks=2) == 2
    assert choose_chain_size(100_000, 1, table) == 1


def test_table_files_round_trip_and_bad_files_name_the_file(tmp_path):
    path = tmp_path / "t.json"
    _table().save(path)
    loaded = PartitionTable.from_file(path)
    assert loaded.to_dict() == _table().to_dict()
    (tmp_path / "bad.json").write_text(json.dumps({"entries": [{"ranks": 2, "context_length": 8,
                                                                  "fractions": [0.9, 0.5]}]}))
    with pytest.raises(ValueError, match=r"bad.json.*fractions \[0.9, 0.5\] must rise to 1.0"):
        PartitionTable.from_file(tmp_path / "bad.json")
    with pytest.raises(ValueError, match="does not exist"):
        PartitionTable.from_file(tmp_path / "missing.json")


def test_the_shipped_table_was_measured_and_is_usable():
    table = PartitionTable.load()
    assert table.name == DEFAULT_TABLE.stem and 2 in table.ranks()
    for entry in table.entries:  # measured: every entry carries its timings
        assert entry.ttft_s > 0 and entry.ttft_even_s > 0 and entry.ttft_single_s > 0
    assert 2 in table.min_context
    crossover = table.min_context[2]
    assert choose_chain_size(crossover, 2) == 2
    assert choose_chain_size(crossover - 1, 2) == 1


def test_a_chains_break_even_is_its_min_context_on_the_device_kind_measured():
    table = _table()
    assert table.device_type == "cpu", "a table that does not say was tuned on the CPU"
    assert (table.break_even(2, "cpu"), table.break_even(3, "cpu"), table.break_even(4, "cpu")) == (1000, 4000, 0)
    assert table.break_even(2, "cuda") == 0, "a CPU's break-even says nothing of a GPU's"
    table.measured_on["device"] = "cuda"
    assert (table.break_even(2, "cuda"), table.break_even(2, "cpu")) == (1000, 0)
    shipped = PartitionTable.load()
    assert shipped.break_even(2, "cpu") == shipped.min_context[2] > 0
