"""baton's CPU attention kernel equals softmax attention under the causal mask: fp32 to an
fp64 reference as closely as torch's own kernel, bf16 within torch's own bf16 error; and
attend() takes it wherever it applies."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from baton.kernels import cpu as cpu_kernels
from baton.model import attention as attention_module
from baton.model.attention import attend, expand_kv_heads
from kernel_builds import kernels_fixture

kernels = kernels_fixture("causal_attention")


def reference(q, k, v):
    """fp64 attention, query t over keys 0 .. S - T + t: [T, H, D]."""
    num_queries, num_keys = q.shape[0], k.shape[0]
    keys = expand_kv_heads(k, q.shape[1]).double().transpose(0, 1)
    values = expand_kv_heads(v, q.shape[1]).double().transpose(0, 1)
    scores = q.double().transpose(0, 1) @ keys.transpose(1, 2) / q.shape[-1] ** 0.5
    visible = torch.arange(num_keys)[None, :] <= (num_keys - num_queries + torch.arange(num_queries))[:, None]
    scores = scores.masked_fill(~visible, float("-inf"))
    return (F.softmax(scores, dim=-1) @ values).transpose(0, 1)


def torch_kernel(q, k, v):
    """torch's fused kernel on the same inputs, for its error as the bar."""
    num_queries, num_keys = q.shape[0], k.shape[0]
    visible = torch.arange(num_keys)[None, :] <= (num_keys - num_queries + torch.arange(num_queries))[:, None]
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1)[None], expand_kv_heads(k, q.shape[1]).transpose(0, 1)[None],
        expand_kv_heads(v, q.shape[1]).transpose(0, 1)[None], attn_mask=visible)
    return out[0].transpose(0, 1)


def random_qkv(num_queries, num_keys, heads, kv_heads, head_dim, dtype, seed):
    generator = torch.Generator().manual_seed(seed)
    shape_q, shape_kv = (num_queries, heads, head_dim), (num_keys, kv_heads, head_dim)
    return (torch.randn(shape_q, generator=generator).to(dtype),
            torch.randn(shape_kv, generator=generator).to(dtype),
            torch.randn(shape_kv, generator=generator).to(dtype))


SHAPES = [  # (queries, keys): whole prompts of every tile remainder, slices over a prefix, one token
    (1, 1), (5, 5), (16, 16), (17, 17), (64, 64), (130, 130), (900, 900),
    (1, 77), (3, 1000), (64, 300), (200, 265),
]


@pytest.mark.parametrize("dtype", cpu_kernels.DTYPES)
@pytest.mark.parametrize("head_dim", cpu_kernels.HEAD_DIMS)
@pytest.mark.parametrize(("num_queries", "num_keys"), SHAPES)
def test_as_exact_as_torchs_kernel(kernels, dtype, head_dim, num_queries, num_keys):
    q, k, v = random_qkv(num_queries, num_keys, 8, 2, head_dim, dtype, seed=num_keys)
    truth = reference(q, k, v)
    out = kernels.causal_attention(q, k, v)
    assert out.dtype == dtype
    ours = (out.double() - truth).abs().max().item()
    theirs = (torch_kernel(q, k, v).double() - truth).abs().max().item()
    if dtype == torch.float32:
        assert ours < 2e-6, (ours, theirs)
    else:  # both round the output (and the probabilities) to bf16: the same error, to a step
        assert ours <= 1.25 * theirs + 1e-3, (ours, theirs)


@pytest.mark.parametrize("heads", [(8, 8), (8, 2), (8, 1), (12, 4)])  # MHA, GQA, MQA, 3 per group
def test_every_head_layout(kernels, heads):
    q, k, v = random_qkv(70, 150, heads[0], heads[1], 64, torch.float32, seed=sum(heads))
    assert (kernels.causal_attention(q, k, v).double() - reference(q, k, v)).abs().max() < 2e-6


def test_attend_takes_the_kernel_for_prompts_and_prefix_slices(kernels, monkeypatch):
    calls = []
    real = kernels.causal_attention

    class Spy:
        def causal_attention(self, q, k, v):
            calls.append((q.shape[0], k.shape[0]))
            return real(q, k, v)

    monkeypatch.setattr(attention_module.cpu_kernels, "kernels", lambda: Spy())
    monkeypatch.setattr(attention_module.cpu_kernels, "has", lambda name: hasattr(kernels, name))
    q, k, v = random_qkv(40, 100, 8, 2, 32, torch.float32, seed=1)
    positions = torch.arange(100)
    # a slice over its prefix; the last 40 queries of a whole prompt; a pruned prefix
    attend(q, k, v, positions[60:], positions)
    attend(q, k[60:], v[60:], positions[60:], positions[60:])
    pruned = torch.cat([torch.arange(0, 120, 2), torch.arange(130, 170)])
    out = attend(q, k, v, pruned[60:], pruned)
    assert calls == [(40, 100), (40, 40), (40, 100)]
    assert (out.double() - reference(q, k, v)).abs().max() < 2e-6
    # a key after its query is not a prefix: the masked path, not the kernel
    attend(q, k, v, positions[60:], positions.flip(0))
    assert len(calls) == 3


@pytest.mark.parametrize("dtype", cpu_kernels.DTYPES)
def test_reads_strided_rows_of_a_fused_projection_in_place(kernels, dtype):
    """q, k and v as views of one [T, (H + 2 Hkv) D] projection (rows strided): the same
    result as contiguous copies, and no copy made on the way in."""
    generator = torch.Generator().manual_seed(5)
    fused = torch.randn(70, (8 + 2 + 2) * 32, generator=generator).to(dtype)
    q = fused[:, :256].view(70, 8, 32)
    k = fused[:, 256:320].view(70, 2, 32)
    v = fused[:, 320:].view(70, 2, 32)
    assert not q.is_contiguous() and cpu_kernels.token_rows(q) is q
    out = kernels.causal_attention(q, k, v)
    assert torch.equal(out, kernels.causal_attention(q.contiguous(), k.contiguous(), v.contiguous()))
    heads_apart = torch.randn(8, 70, 32).to(dtype).transpose(0, 1)  # a token's heads not side by side
    with pytest.raises(RuntimeError, match="side by side"):
        kernels.causal_attention(heads_apart, k, v)
    assert torch.equal(kernels.causal_attention(cpu_kernels.token_rows(heads_apart), k, v),
                       kernels.causal_attention(heads_apart.contiguous(), k, v))


def test_bad_inputs_are_refused_with_the_value(kernels):
    q, k, v = random_qkv(4, 8, 8, 2, 32, torch.float32, seed=2)
    with pytest.raises(RuntimeError, match="fewer keys"):
        kernels.causal_attention(q, k[:2], v[:2])
    with pytest.raises(RuntimeError, match="head_dim 16"):
        kernels.causal_attention(q[..., :16].contiguous(), k[..., :16].contiguous(), v[..., :16].contiguous())
    with pytest.raises(RuntimeError, match="share a dtype"):
        kernels.causal_attention(q, k.double(), v)


def test_switched_off_by_the_environment(monkeypatch):
    monkeypatch.setenv("BATON_CPU_KERNELS", "0")
    assert cpu_kernels.kernels.__wrapped__() is None


def test_kernels_build_with_the_pinned_ninja_whatever_path_finds_first(tmp_path, monkeypatch):
    # Two ninja versions record a build's commands differently: callers with different PATHs
    # (make run, an activated virtualenv) took each other's build for stale and rebuilt it.
    ninja = pytest.importorskip("ninja")
    other = tmp_path / "ninja"
    other.write_text("#!/bin/sh\nexit 1\n")
    other.chmod(0o755)
    path = f"{tmp_path}{os.pathsep}{os.environ.get('PATH', '')}"
    monkeypatch.setenv("PATH", path)
    assert shutil.which("ninja") == str(other)
    with cpu_kernels.pinned_ninja():
        assert Path(shutil.which("ninja")).parent == Path(ninja.BIN_DIR)
    assert os.environ["PATH"] == path
