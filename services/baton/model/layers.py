"""The layers of a Llama-family decoder, Hugging Face's parameter names and all: RMSNorm
(and Gemma's 1 + w form), attention's projections (RoPE applied), the gated MLP, fused
projections, a decoder layer (with Gemma's sandwich norms) and the backbone (``model.*``).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from baton.kernels import cpu as cpu_kernels
from baton.model.config import ModelConfig
from baton.model.linear import FusedLinear, Linear
from baton.model.moe import SparseMoE
from baton.model.rope import apply_rotary
from baton.model.sharding import Collectives, ShardLayout, SingleRank


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if cpu_kernels.elementwise_fits(x, self.weight) and x.is_contiguous():
            return cpu_kernels.kernels().rms_norm(x, self.weight, self.eps)  # one pass
        dtype = x.dtype
        # One fused kernel for x / rms(x) in fp32, then Llama's cast back before the weight.
        x32 = F.rms_norm(x.to(torch.float32), self.weight.shape, eps=self.eps)
        return x32.to(dtype).mul_(self.weight)  # a fresh tensor either way: scale it in place


class OffsetRMSNorm(nn.Module):
    """Gemma's RMSNorm: the weight is stored as w - 1 and everything is computed in fp32
    before the one cast back (Llama casts before the weight)."""

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.to(torch.float32)
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (x32 * (1.0 + self.weight.to(torch.float32))).to(x.dtype)


def make_norm(config: ModelConfig, size: int) -> nn.Module:
    return (OffsetRMSNorm if config.gemma_layout else RMSNorm)(size, config.rms_norm_eps)


class SelfAttention(nn.Module):
    """Attention's projections over this rank's heads (all of them unless sharded)."""

    def __init__(self, config: ModelConfig, layout: ShardLayout) -> None:
        super().__init__()
        self.num_heads = layout.num_heads
        self.num_kv_heads = layout.num_kv_heads
        self.head_dim = config.head_dim
        bias = config.attention_bias
        self.q_proj = Linear(config.hidden_size, self.num_heads * self.head_dim, bias=bias)
        self.k_proj = Linear(config.hidden_size, self.num_kv_heads * self.head_dim, bias=bias)
        self.v_proj = Linear(config.hidden_size, self.num_kv_heads * self.head_dim, bias=bias)
        self.o_proj = Linear(self.num_heads * self.head_dim, config.hidden_size, bias=False)
        self.qkv: FusedLinear | None = None
        if config.qk_norm:  # Qwen3, Gemma 3: each head's queries and keys normed before RoPE
            self.q_norm = make_norm(config, self.head_dim)
            self.k_norm = make_norm(config, self.head_dim)
        self.qk_norm = config.qk_norm
        # Gemma scales scores by query_pre_attn_scalar^-1/2, not head_dim^-1/2: the queries
        # are scaled by the ratio, and every attention kernel keeps its own scale.
        self.query_scale = 1.0
        if config.query_pre_attn_scalar:
            self.query_scale = math.sqrt(self.head_dim / config.query_pre_attn_scalar)

    def fuse(self) -> None:
        """One matmul for q, k and v (see ``CausalLM.fuse_projections``)."""
        self.qkv = FusedLinear(self.q_proj, self.k_proj, self.v_proj)

    def project(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """x: [N, hidden] -> q [N, H, D], k, v [N, Hkv, D], RoPE applied to q and k."""
        n = x.shape[0]
        if self.qkv is not None:
            fused = self.qkv.output(x)
            if (cpu_kernels.elementwise_fits(fused) and self.head_dim % 32 == 0
                    and not self.qk_norm and cos.shape[-1] == self.head_dim):
                # RoPE in place on the q and k heads of the fused output, one pass
                cpu_kernels.kernels().rotary_(fused, cos.view(n, -1), sin.view(n, -1),
                                              self.num_heads + self.num_kv_heads, self.head_dim)
                q, k, v = fused.split(self.qkv.sizes, dim=-1)
                return (self._scaled(q.view(n, self.num_heads, self.head_dim)),
                        k.view(n, self.num_kv_heads, self.head_dim),
                        v.view(n, self.num_kv_heads, self.head_dim))
            q, k, v = fused.split(self.qkv.sizes, dim=-1)
        else:
            q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        q = q.view(n, self.num_heads, self.head_dim)
        k = k.view(n, self.num_kv_heads, self.head_dim)
        v = v.view(n, self.num_kv_heads, self.head_dim)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        return self._scaled(apply_rotary(q, cos, sin)), apply_rotary(k, cos, sin), v

    def _scaled(self, q: torch.Tensor) -> torch.Tensor:
        return q if self.query_scale == 1.0 else q * self.query_scale


# On the CPU a prompt-sized batch goes through the MLP in blocks of rows whose gate/up
# activations take about this much. Whole, an 8192-token step's are ~45 MiB in fp32 (the
# shipped model): more than the L3 cache, and more than glibc serves from its heap (32
# MiB at most), so every layer of every such step had them page-faulted in anew.
MLP_BLOCK_BYTES = 8 * 2**20
MLP_MIN_BLOCK_ROWS = 256  # below this, matmuls use the CPU less well


class MLP(nn.Module):
    """The gated MLP over this rank's part of the intermediate width (all of it unless sharded)."""

    def __init__(self, config: ModelConfig, layout: ShardLayout) -> None:
        super().__init__()
        width = layout.intermediate_size
        self.gate_proj = Linear(config.hidden_size, width, bias=False)
        self.up_proj = Linear(config.hidden_size, width, bias=False)
        self.down_proj = Linear(width, config.hidden_size, bias=False)
        self.gate_up: FusedLinear | None = None
        self.gelu = config.hidden_act == "gelu_pytorch_tanh"  # else SiLU

    def fuse(self) -> None:
        """One matmul for gate and up (see ``CausalLM.fuse_projections``)."""
        self.gate_up = FusedLinear(self.gate_proj, self.up_proj)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = self.block_rows(x)
        if x.shape[0] <= rows:
            return self._forward(x)
        out = torch.empty_like(x)
        for start in range(0, x.shape[0], rows):  # rows are independent: same result
            out[start:start + rows] = self._forward(x[start:start + rows])
        return out

    def block_rows(self, x: torch.Tensor) -> int:
        """How many rows go through at once (all of them on a GPU)."""
        if x.device.type != "cpu":
            return x.shape[0]
        row_bytes = 2 * self.gate_proj.out_features * x.element_size()
        return max(MLP_MIN_BLOCK_ROWS, MLP_BLOCK_BYTES // row_bytes)

    def _forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gate_up is not None:
            fused = self.gate_up.output(x)
            if not self.gelu and cpu_kernels.elementwise_fits(fused) and fused.shape[1] % 32 == 0:
                return self.down_proj(cpu_kernels.kernels().silu_and_mul(fused))  # one pass
            gate, up = fused.split(self.gate_up.sizes, dim=-1)
        else:
            gate, up = self.gate_proj(x), self.up_proj(x)
        activated = F.gelu(gate, approximate="tanh") if self.gelu else F.silu(gate)
        return self.down_proj(activated.mul_(up))


class DecoderLayer(nn.Module):
    """One layer. Sharded, o_proj and the feed-forward's down projection each leave a partial
    sum on every rank, completed by one all-reduce before it joins the residual stream."""

    def __init__(self, config: ModelConfig, index: int, layout: ShardLayout,
                 collectives: Collectives) -> None:
        super().__init__()
        self.collectives = collectives
        self.self_attn = SelfAttention(config, layout)
        # the feed-forward part, under the checkpoint's name: a dense MLP, or experts
        self.feed_forward_name = "mlp"
        if config.is_sparse_layer(index):
            self.feed_forward_name = "block_sparse_moe" if config.family == "mixtral" else "mlp"
            setattr(self, self.feed_forward_name, SparseMoE(config, layout))
        else:
            self.mlp = MLP(config, layout)
        self.input_layernorm = make_norm(config, config.hidden_size)
        # Llama's post_attention_layernorm is the feed-forward's input norm; Gemma's norms
        # attention's output, and two more norm the feed-forward's input and output
        self.post_attention_layernorm = make_norm(config, config.hidden_size)
        self.sandwich_norms = config.gemma_layout
        if self.sandwich_norms:
            self.pre_feedforward_layernorm = make_norm(config, config.hidden_size)
            self.post_feedforward_layernorm = make_norm(config, config.hidden_size)

    @property
    def feed_forward(self) -> nn.Module:
        return getattr(self, self.feed_forward_name)

    def add_attention(self, hidden: torch.Tensor, attention: torch.Tensor) -> None:
        """hidden += o_proj(attention) (normed first under sandwich norms); in place."""
        out = self.self_attn.o_proj(attention)
        self.collectives.all_reduce_(out)
        hidden.add_(self.post_attention_layernorm(out) if self.sandwich_norms else out)

    def add_feed_forward(self, hidden: torch.Tensor) -> None:
        """hidden += the feed-forward of its normed self; in place."""
        if self.sandwich_norms:
            out = self.feed_forward(self.pre_feedforward_layernorm(hidden))
            self.collectives.all_reduce_(out)
            hidden.add_(self.post_feedforward_layernorm(out))
        else:
            out = self.feed_forward(self.post_attention_layernorm(hidden))
            self.collectives.all_reduce_(out)
            hidden.add_(out)


class Backbone(nn.Module):
    """Hugging Face's ``model.*`` submodule: embeddings, layers, final norm. Sharded, the
    embedding holds this rank's run of the vocabulary; a token outside it looks up zeros,
    and the all-reduce adds the one rank's row that holds it."""

    def __init__(self, config: ModelConfig, layout: ShardLayout | None = None,
                 collectives: Collectives | None = None) -> None:
        super().__init__()
        self.layout = layout or ShardLayout(config)
        self.collectives = collectives or SingleRank()
        self.embed_tokens = nn.Embedding(self.layout.vocab_per_rank, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, index, self.layout, self.collectives)
                                    for index in range(config.num_hidden_layers))
        self.norm = make_norm(config, config.hidden_size)
        # Gemma multiplies the embeddings by sqrt(hidden_size), rounded to their dtype
        self.embedding_scale = config.hidden_size ** 0.5 if config.gemma_layout else None

    def embed(self, token_ids: torch.Tensor) -> torch.Tensor:
        if self.layout.size == 1:
            hidden = self.embed_tokens(token_ids)
        else:
            local = token_ids - self.layout.vocab_start
            outside = (local < 0) | (local >= self.layout.vocab_per_rank)
            hidden = self.embed_tokens(local.masked_fill(outside, 0))
            hidden.masked_fill_(outside.unsqueeze(-1), 0.0)
            self.collectives.all_reduce_(hidden)
        if self.embedding_scale is not None:
            hidden.mul_(torch.tensor(self.embedding_scale).to(hidden.dtype))
        return hidden
