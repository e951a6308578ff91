"""A sparse mixture of experts in place of a layer's MLP (Mixtral, Qwen3-MoE).

Each token's router scores pick its top-k experts (softmax over every expert in fp32, then
the k best, renormalised to sum to 1 where the family does: Mixtral always, Qwen3-MoE with
``norm_topk_prob``); its output is their gated MLPs' outputs weighted so. The tokens are
grouped by expert once (a sort of the N x k choices) and each expert runs once over all of
its tokens: a loop over experts, none over tokens, so a batch's cost is its experts' matmuls.
Parameter names are the checkpoint's (``experts.{e}.w1/w3/w2`` for Mixtral,
``experts.{e}.gate_proj/up_proj/down_proj`` for Qwen3-MoE).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from baton.kernels import cpu as cpu_kernels
from baton.model.config import ModelConfig
from baton.model.linear import FusedLinear, Linear
from baton.model.sharding import ShardLayout

# (gate, up, down) in each family's checkpoints
EXPERT_NAMES = {"mixtral": ("w1", "w3", "w2"), "qwen3_moe": ("gate_proj", "up_proj", "down_proj")}


class Expert(nn.Module):
    """One expert: a gated SiLU MLP under its family's parameter names."""

    def __init__(self, hidden_size: int, intermediate_size: int, names: tuple[str, str, str]) -> None:
        super().__init__()
        self.names = names
        gate, up, down = names
        setattr(self, gate, Linear(hidden_size, intermediate_size, bias=False))
        setattr(self, up, Linear(hidden_size, intermediate_size, bias=False))
        setattr(self, down, Linear(intermediate_size, hidden_size, bias=False))
        self.gate_up: FusedLinear | None = None

    def fuse(self) -> None:
        """One matmul for gate and up, as a dense MLP's: an expert's few rows of a decode
        step pay a matmul's fixed cost once less."""
        self.gate_up = FusedLinear(getattr(self, self.names[0]), getattr(self, self.names[1]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up, down = (getattr(self, name) for name in self.names)
        if self.gate_up is None:
            return down(F.silu(gate(x)).mul_(up(x)))
        fused = self.gate_up.output(x)
        if cpu_kernels.elementwise_fits(fused) and fused.shape[1] % 32 == 0:
            return down(cpu_kernels.kernels().silu_and_mul(fused))  # one pass
        gate_out, up_out = fused.split(self.gate_up.sizes, dim=-1)
        return down(F.silu(gate_out).mul_(up_out))


class SparseMoE(nn.Module):
    """Sharded, every expert holds this rank's part of its width (the router is whole), so
    the layer's output is a partial sum like a dense MLP's."""

    def __init__(self, config: ModelConfig, layout: ShardLayout | None = None) -> None:
        super().__init__()
        self.top_k = config.num_experts_per_tok
        self.renormalize = config.norm_topk_prob
        self.gate = Linear(config.hidden_size, config.num_experts, bias=False)
        names = EXPERT_NAMES[config.family]
        width = (layout or ShardLayout(config)).expert_intermediate_size
        self.experts = nn.ModuleList(Expert(config.hidden_size, width, names)
                                     for _ in range(config.num_experts))

    def fuse(self) -> None:
        for expert in self.experts:
            expert.fuse()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [N, hidden] -> [N, hidden]."""
        scores = F.softmax(self.gate(x), dim=-1, dtype=torch.float32)  # [N, E]
        weights, chosen = torch.topk(scores, self.top_k, dim=-1)  # [N, k]
        if self.renormalize:
            weights /= weights.sum(dim=-1, keepdim=True)
        weights = weights.to(x.dtype).view(-1)  # [N * k], the choice n * k + j
        choices = torch.argsort(chosen.view(-1), stable=True)  # grouped by expert
        counts = torch.bincount(chosen.view(-1), minlength=len(self.experts)).tolist()
        out = torch.zeros_like(x)
        start = 0
        for expert, count in zip(self.experts, counts, strict=True):
            if count:
                mine = choices[start:start + count]
                tokens = mine // self.top_k
                out.index_add_(0, tokens, expert(x.index_select(0, tokens)) * weights[mine, None])
            start += count
        return out
