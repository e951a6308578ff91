"""linear() and the weight-major orientation give F.linear's result, for every row count it takes; a packed bf16 weight gives it exactly where oneDNN packs bf16, to rounding where it is widened."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from baton.model.linear import Linear, linear, pack_dtype, packs, weight_major, weight_major_linear


@pytest.mark.parametrize("num_outputs", [96, 8192])
@pytest.mark.parametrize("num_rows", [1, 2, 4, 5, 64, 65])
@pytest.mark.parametrize("with_bias", [False, True])
def test_linear_equals_f_linear(num_rows, num_outputs, with_bias):
    generator = torch.Generator().manual_seed(num_rows)
    x = torch.randn(num_rows, 48, generator=generator)
    weight = torch.randn(num_outputs, 48, generator=generator)
    bias = torch.randn(num_outputs, generator=generator) if with_bias else None
    for out in (linear(x, weight, bias), weight_major_linear(x, weight, bias)):
        assert out.shape == (num_rows, num_outputs) and out.is_contiguous()
        assert torch.allclose(out, F.linear(x, weight, bias), atol=1e-4, rtol=1e-5)


def test_orientation_rule():
    assert weight_major(1, 512) and weight_major(4, 4096)
    assert not weight_major(5, 4096) and not weight_major(512, 1024)
    assert weight_major(64, 32000) and not weight_major(65, 32000)


def test_linear_module_keeps_nn_linear_parameters_and_takes_any_shape():
    layer = Linear(16, 8, bias=True)
    assert set(dict(layer.named_parameters())) == {"weight", "bias"}
    batch = torch.randn(3, 5, 16)  # 3-D input (training): plain F.linear
    assert torch.allclose(layer(batch), F.linear(batch, layer.weight, layer.bias))
    row = torch.randn(1, 16)
    assert torch.allclose(layer(row), F.linear(row, layer.weight, layer.bias), atol=1e-6)


@pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="needs oneDNN")
@torch.no_grad()
def test_bf16_packs_itself_where_onednn_can_and_widened_to_fp32_elsewhere():
    torch.manual_seed(0)
    layer = Linear(64, 96, bias=True).to(torch.bfloat16)
    native = torch.ops.mkldnn._is_mkldnn_bf16_supported()
    assert pack_dtype(torch.bfloat16) == (torch.bfloat16 if native else torch.float32)
    assert packs(layer.weight)
    for rows in (1, 3, 64, 300):
        x = torch.randn(rows, 64, dtype=torch.bfloat16)
        ours, theirs = layer(x), F.linear(x, layer.weight, layer.bias)
        assert ours.dtype == torch.bfloat16
        # widened, the products are exact and the sums fp32, as in torch's bf16 kernel: the two
        # differ by the order of the sums, so at most one bf16 rounding apart
        truth = F.linear(x.double(), layer.weight.double(), layer.bias.double())
        our_error = (ours.double() - truth).abs().max()
        their_error = (theirs.double() - truth).abs().max()
        assert our_error <= their_error + truth.abs().max() * 2 ** -8


@pytest.mark.skipif(not (torch.backends.mkldnn.is_available()
                         and torch.ops.mkldnn._is_mkldnn_bf16_supported()),
                    reason="oneDNN packs bf16 only with AVX-512 BW/VL/DQ or AVX-NE-CONVERT")
@torch.no_grad()  # as served; a forward that trains takes the plain kernels
def test_a_packed_bf16_weight_gives_f_linear_exactly_and_follows_weight_changes():
    torch.manual_seed(0)
    layer = Linear(64, 96, bias=True).to(torch.bfloat16)
    assert packs(layer.weight)
    for rows in (1, 3, 64, 300):
        x = torch.randn(rows, 64, dtype=torch.bfloat16)
        assert torch.equal(layer(x), F.linear(x, layer.weight, layer.bias))
    with torch.no_grad():  # edited in place (a reload writes through like this)
        layer.weight.mul_(2)
    x = torch.randn(5, 64, dtype=torch.bfloat16)
    assert torch.equal(layer(x), F.linear(x, layer.weight, layer.bias))


@pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="needs oneDNN")
@torch.no_grad()
def test_a_packed_fp32_weight_agrees_with_f_linear_to_rounding():
    # fp32 packs too (1.2-1.5x on the development CPUs); oneDNN sums in another order than
    # BLAS, so the results agree to fp32 rounding, not bit for bit.
    torch.manual_seed(0)
    layer = Linear(64, 96, bias=True)
    assert packs(layer.weight)
    for rows in (1, 3, 64, 300):
        x = torch.randn(rows, 64)
        assert torch.allclose(layer(x), F.linear(x, layer.weight, layer.bias), rtol=1e-5, atol=1e-5)
    assert not packs(layer.weight.double())  # other dtypes keep the plain kernels


def test_a_forward_that_trains_takes_the_plain_kernels_and_has_gradients():
    layer = Linear(64, 96, bias=True)
    layer(torch.randn(3, 64)).sum().backward()
    assert layer.weight.grad is not None and layer.weight.grad.abs().sum() > 0
