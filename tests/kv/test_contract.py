"""The KV contract: what must match between a chain and a decode pod, and what need not."""

from __future__ import annotations

import dataclasses

import pytest
from baton.config import PyramidConfig
from baton.kv.contract import COMPRESSION_OFF, HEADS_COMPLETE, KVContract, compression_of

POD = KVContract("tiny", "rev-1", dtype="float32", num_layers=4, num_kv_heads=2, head_dim=8,
                 layout=HEADS_COMPLETE, compression="pyramid keep_ratio 0.5", block_size=16)


def test_the_same_contract_fits():
    assert POD.mismatches(POD) == []


@pytest.mark.parametrize("change, words", [
    ({"model_id": "big"}, "model 'big' != 'tiny'"),
    ({"model_revision": "rev-2"}, "model revision 'rev-2' != 'rev-1'"),
    ({"model_revision": ""}, "model revision '' != 'rev-1'"),
    ({"dtype": "bfloat16"}, "kv dtype bfloat16 != float32"),
    ({"num_layers": 3}, "num layers 3 != 4"),
    ({"num_kv_heads": 1}, "num kv heads 1 != 2"),
    ({"head_dim": 16}, "head_dim 16 != 8"),
    ({"layout": "heads-of-rank"}, "kv layout heads-of-rank != heads-complete"),
    ({"compression": "uniform keep_ratio 0.5"},
     "compression uniform keep_ratio 0.5 != pyramid keep_ratio 0.5"),
])
def test_each_difference_that_changes_what_is_shipped_is_named(change, words):
    assert dataclasses.replace(POD, **change).mismatches(POD) == [words]


def test_every_mismatch_is_listed_with_the_shipping_side_first():
    chain = dataclasses.replace(POD, model_revision="rev-2", dtype="bfloat16")
    assert chain.mismatches(POD) == ["model revision 'rev-2' != 'rev-1'",
                                     "kv dtype bfloat16 != float32"]


def test_tensor_parallel_size_and_block_size_are_information_only():
    # The chain ships every KV head, token by token: a pod shards and blocks it its own way.
    chain = dataclasses.replace(POD, tensor_parallel_size=1, block_size=0)
    pod = dataclasses.replace(POD, tensor_parallel_size=4, block_size=32)
    assert chain.mismatches(pod) == [] and pod.mismatches(chain) == []


def test_compression_off_on_either_side_fits():
    # A pod that does not compress stores a pruned cache as it comes; a chain that does not
    # compress ships everything.
    off = dataclasses.replace(POD, compression=COMPRESSION_OFF)
    assert off.mismatches(POD) == [] and POD.mismatches(off) == []


def test_what_a_side_does_not_say_is_not_compared():
    # A record of an earlier release says only its model, revision and dtype; a pushed
    # cache's header says no more than its shape.
    earlier = KVContract("tiny", "rev-1", dtype="float32")
    assert earlier.mismatches(POD) == [] and POD.mismatches(earlier) == []
    assert KVContract("tiny", "rev-1").mismatches(dataclasses.replace(POD, dtype="bfloat16")) == []


def test_compression_in_words():
    assert compression_of(PyramidConfig(enabled=False)) == COMPRESSION_OFF
    assert compression_of(PyramidConfig(policy="local", keep_ratio=0.25)) == "local keep_ratio 0.25"
