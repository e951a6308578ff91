"""The few-rows linear kernel equals F.linear: in fp32 to rounding (another summation order),
in bf16 no farther from the exact product than torch's result."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from baton.kernels import cpu as cpu_kernels
from baton.model.linear import Linear
from kernel_builds import kernels_fixture

kernels = kernels_fixture("few_rows_linear")  # not the avx512_bf16 build's (oneDNN's bf16 kernels serve there)


def inputs(rows: int, in_features: int, out_features: int, dtype: torch.dtype, seed: int):
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, in_features, generator=generator).to(dtype)
    weight = (torch.randn(out_features, in_features, generator=generator) / in_features ** 0.5).to(dtype)
    bias = torch.randn(out_features, generator=generator).to(dtype)
    return x, weight, bias


def assert_close(ours, x, weight, bias):
    theirs = F.linear(x, weight, bias)
    assert ours.shape == theirs.shape and ours.dtype == theirs.dtype
    if ours.dtype == torch.float32:
        torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)
        return
    truth = F.linear(x.double(), weight.double(), None if bias is None else bias.double())
    our_error = (ours.double() - truth).abs().max()
    their_error = (theirs.double() - truth).abs().max()
    assert our_error <= their_error + truth.abs().max() * 2 ** -8


@pytest.mark.parametrize("dtype", cpu_kernels.DTYPES)
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 7, 8, 13, 16])
def test_every_tile_of_rows(kernels, dtype, rows):
    # 1376 outputs: 172 groups of 8, split between threads; 256 in: the shipped model's
    x, weight, bias = inputs(rows, 256, 1376, dtype, seed=rows)
    assert_close(kernels.few_rows_linear(x, weight, None), x, weight, None)
    assert_close(kernels.few_rows_linear(x, weight, bias), x, weight, bias)


@pytest.mark.parametrize("out_features", [1, 7, 13, 4101])
def test_outputs_past_the_last_group_of_eight(kernels, out_features):
    x, weight, bias = inputs(3, 64, out_features, torch.float32, seed=out_features)
    assert_close(kernels.few_rows_linear(x, weight, bias), x, weight, bias)


def test_rows_at_a_stride_and_no_rows(kernels):
    x, weight, _ = inputs(4, 128, 64, torch.float32, seed=1)
    wide = torch.cat([x, torch.full_like(x, float("nan"))], dim=1)  # rows 256 apart, NaN beyond
    strided = wide[:, :128]
    assert_close(kernels.few_rows_linear(strided, weight, None), strided, weight, None)
    assert kernels.few_rows_linear(x[:0], weight, None).shape == (0, 64)


def test_bad_inputs_are_refused_with_the_value(kernels):
    with pytest.raises(RuntimeError, match=f"in features 12 is not a multiple of {kernels.lanes}"):
        kernels.few_rows_linear(torch.ones(2, 12), torch.ones(8, 12), None)
    with pytest.raises(RuntimeError, match=r"weight must be a contiguous \[out, 16\]"):
        kernels.few_rows_linear(torch.ones(2, 16), torch.ones(8, 24), None)
    with pytest.raises(RuntimeError, match=r"bias must be a contiguous \[8\]"):
        kernels.few_rows_linear(torch.ones(2, 16), torch.ones(8, 16), torch.ones(9))
    with pytest.raises(RuntimeError, match="dtype Double"):
        kernels.few_rows_linear(torch.ones(2, 16, dtype=torch.float64), torch.ones(8, 16, dtype=torch.float64), None)


def test_the_linear_layer_takes_it_for_a_decode_batch_only(kernels, monkeypatch):
    # as on a CPU whose build holds the kernel (an AVX512-BF16 host's does not)
    monkeypatch.setattr(cpu_kernels, "kernels", lambda: kernels)
    monkeypatch.setattr(cpu_kernels, "has", lambda name: hasattr(kernels, name))
    layer = Linear(256, 688).requires_grad_(False)
    x = torch.randn(cpu_kernels.MAX_FEW_ROWS + 1, 256)
    assert cpu_kernels.few_rows_linear_fits(x[:1], layer.weight, layer.bias)
    assert not cpu_kernels.few_rows_linear_fits(x, layer.weight, layer.bias)  # a prompt's rows: oneDNN
    with torch.no_grad():
        for rows in (1, 4, cpu_kernels.MAX_FEW_ROWS, cpu_kernels.MAX_FEW_ROWS + 1):
            assert_close(layer(x[:rows]), x[:rows], layer.weight, layer.bias)
