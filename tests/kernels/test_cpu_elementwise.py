"""baton's element-wise CPU kernels equal the torch forms they replace: in fp32 to rounding;
in bf16 at least as close to the exact result as torch (they round once where torch
rounds after every step)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from baton.kernels import cpu as cpu_kernels
from baton.model.rope import rotate_half
from kernel_builds import kernels_fixture

kernels = kernels_fixture("rms_norm")


def close(ours, theirs, truth):
    """fp32: equal to rounding; bf16: no farther from the truth (fp64, same inputs) than
    torch's own result, to within one bf16 step of the largest value."""
    if ours.dtype == torch.float32:
        return torch.allclose(ours, theirs, rtol=1e-5, atol=1e-6)
    our_error = (ours.double() - truth).abs().max()
    their_error = (theirs.double() - truth).abs().max()
    return bool(our_error <= their_error + truth.abs().max() * 2 ** -8)


@pytest.mark.parametrize("dtype", cpu_kernels.DTYPES)
@pytest.mark.parametrize("rows", [1, 7, 64, 300])
def test_silu_and_mul(kernels, dtype, rows):
    x = (torch.randn(rows, 2 * 688, generator=torch.Generator().manual_seed(rows)) * 4).to(dtype)
    gate, up = x.split(688, dim=-1)
    truth = F.silu(gate.double()) * up.double()
    assert close(kernels.silu_and_mul(x), F.silu(gate) * up, truth)


def test_silu_of_extremes_is_finite_and_exact(kernels):
    x = torch.tensor([[-1e4, -100.0, -20.0, -1e-30, 0.0, 1e-30, 20.0, 100.0, 1e4] + [0.0] * 7 + [1.0] * 16])
    # (torch flushes silu(-100) = -3.7e-42, a denormal, to 0)
    assert torch.allclose(kernels.silu_and_mul(x)[0], F.silu(x[0, :16]), rtol=1e-6, atol=1e-38)


@pytest.mark.parametrize("dtype", cpu_kernels.DTYPES)
@pytest.mark.parametrize("width", [64, 256, 768])
def test_rms_norm_is_llamas(kernels, dtype, width):
    generator = torch.Generator().manual_seed(width)
    x = (torch.randn(33, width, generator=generator) * 3).to(dtype)
    weight = (torch.rand(width, generator=generator) + 0.5).to(dtype)
    # Hugging Face's LlamaRMSNorm
    x32 = x.float()
    reference = weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + 1e-5)).to(dtype)
    x64 = x.double()
    truth = weight.double() * (x64 * torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + 1e-5)).to(dtype).double()
    assert close(kernels.rms_norm(x, weight, 1e-5), reference, truth)


@pytest.mark.parametrize("dtype", cpu_kernels.DTYPES)
@pytest.mark.parametrize("head_dim", [32, 64, 128])
def test_rotary_in_place_on_the_q_and_k_heads_only(kernels, dtype, head_dim):
    generator = torch.Generator().manual_seed(head_dim)
    heads, kv_heads, rows = 4, 2, 19
    fused = torch.randn(rows, (heads + 2 * kv_heads) * head_dim, generator=generator).to(dtype)
    angles = torch.rand(rows, head_dim // 2, generator=generator) * 50
    cos = torch.cat([angles, angles], -1).cos().to(dtype)
    sin = torch.cat([angles, angles], -1).sin().to(dtype)
    x = fused.view(rows, -1, head_dim)
    reference = x * cos[:, None] + rotate_half(x) * sin[:, None]
    truth = x.double() * cos.double()[:, None] + rotate_half(x.double()) * sin.double()[:, None]
    untouched = fused[:, (heads + kv_heads) * head_dim:].clone()
    kernels.rotary_(fused, cos, sin, heads + kv_heads, head_dim)
    rotated = fused.view(rows, -1, head_dim)[:, :heads + kv_heads]
    assert close(rotated, reference[:, :heads + kv_heads], truth[:, :heads + kv_heads])
    assert torch.equal(fused[:, (heads + kv_heads) * head_dim:], untouched)


def test_bad_shapes_are_refused_with_the_value(kernels):
    with pytest.raises(RuntimeError, match="width 40 is not a multiple of 16"):
        kernels.rms_norm(torch.ones(2, 40), torch.ones(40), 1e-5)
    with pytest.raises(RuntimeError, match="weight must be a contiguous \\[64\\]"):
        kernels.rms_norm(torch.ones(2, 64), torch.ones(32), 1e-5)
    with pytest.raises(RuntimeError, match="head_dim 16 is not a multiple of 32"):
        kernels.rotary_(torch.ones(2, 64), torch.ones(2, 16), torch.ones(2, 16), 2, 16)
    with pytest.raises(RuntimeError, match="dtype Double"):
        kernels.silu_and_mul(torch.ones(2, 64, dtype=torch.float64))
