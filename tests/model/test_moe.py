"""Routed experts under loads as uneven as they come: most tokens on one expert, some
experts with none, a batch of one token. Each token's output equals its own top-k experts'
weighted sum, computed one token at a time."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from baton.model.moe import SparseMoE
from hf_reference import tiny_config


def one_token_at_a_time(moe: SparseMoE, x: torch.Tensor) -> torch.Tensor:
    rows = []
    for token in x:
        scores = F.softmax(moe.gate(token[None]), dim=-1, dtype=torch.float32)[0]
        weights, chosen = torch.topk(scores, moe.top_k)
        if moe.renormalize:
            weights = weights / weights.sum()
        rows.append(sum(w * moe.experts[int(e)](token[None])[0] for w, e in zip(weights, chosen)))
    return torch.stack(rows)


@pytest.mark.parametrize("variant", ["mixtral", "qwen3_moe"])
@pytest.mark.parametrize("num_tokens", [1, 7, 64])
def test_uneven_expert_loads_give_each_token_its_own_experts(variant, num_tokens):
    torch.manual_seed(num_tokens)
    config = tiny_config(variant)
    moe = SparseMoE(config).eval()
    with torch.no_grad():
        for parameter in moe.parameters():
            parameter.normal_(0, 0.1)
        moe.gate.weight[0] += 2.0  # expert 0 takes nearly every token, the last ones few or none
        x = torch.randn(num_tokens, config.hidden_size).abs()
        counts = torch.bincount(torch.topk(moe.gate(x), moe.top_k).indices.view(-1),
                                minlength=config.num_experts)
        assert counts[0] == num_tokens  # as uneven as it gets
        assert torch.allclose(moe(x), one_token_at_a_time(moe, x), atol=1e-6)
