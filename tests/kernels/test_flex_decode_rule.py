"""When decode attention reads a paged cache in place through FlexAttention (``baton.kernels
.flex_decode``): its kernel is checked against the gathered read on a GPU (tests/gpu); here,
the rule that picks it."""

from __future__ import annotations

import torch
from baton.kernels import flex_decode


def test_only_a_cuda_device_and_a_shape_its_decoding_kernel_takes_fit():
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert not flex_decode.fits(torch.bfloat16, cpu, 64, 32, 8)
    if flex_decode._available():
        assert flex_decode.fits(torch.bfloat16, cuda, 64, 32, 8)
    assert not flex_decode.fits(torch.bfloat16, cuda, 64, 24, 8)  # 3 query heads per KV head
    assert not flex_decode.fits(torch.bfloat16, cuda, 96, 32, 8)  # a head size not a power of two
    assert not flex_decode.fits(torch.float8_e4m3fn, cuda, 64, 32, 8)


def test_replayed_steps_read_in_place_from_min_rows_up_unless_told(monkeypatch):
    monkeypatch.delenv("BATON_FLEX_DECODE", raising=False)
    assert flex_decode.wanted(flex_decode.MIN_ROWS) and not flex_decode.wanted(flex_decode.MIN_ROWS - 1)
    monkeypatch.setenv("BATON_FLEX_DECODE", "1")
    assert flex_decode.wanted(1)
    monkeypatch.setenv("BATON_FLEX_DECODE", "0")
    assert not flex_decode.wanted(256) and not flex_decode.enabled()
    assert not flex_decode.fits(torch.bfloat16, torch.device("cuda"), 64, 32, 8)


def test_the_row_buckets_are_powers_of_two():
    assert [flex_decode.bucket(rows) for rows in (1, 2, 3, 5, 64, 65)] == [1, 2, 4, 8, 64, 128]
