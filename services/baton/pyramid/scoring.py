"""Scoring context tokens by the attention of recent queries, and picking the best of them.

PyramidInfer's selector: the tokens that matter to what comes next are those
the most recent queries attend to (the paper's "recent attention
consistency"). For one layer, the score of key s is

    score[s] = sum_r  w_r * mean_h softmax_s(q[r, h] . k[s, h // G] / sqrt(D))

over the recent queries r (weights w rising linearly with position, newest
heaviest) and all H query heads (G = H / Hkv query heads share a KV head).
Averaging over every query head gives one score per token, so one token set
per layer serves all KV heads — a pruned layer stays one block table.

The probabilities are computed explicitly, and only for the recent queries:
R x S per head against the T x S of the layer's full attention, with R ~ 20%
of the prompt (and the full attention never materialises its probabilities).
On CPUs with AVX-512 a kernel of ours computes them (``attention_scores`` in
baton/kernels/attention_scores.cpp: docs/runtime.md); elsewhere torch's ops below, the
reference it is tested against.
"""

from __future__ import annotations

import torch

from baton.config import PyramidConfig
from baton.kernels import cpu as cpu_kernels
from baton.model.attention import visibility_mask

# Recent queries scored per matmul: bounds the [Hkv, rows * G, S] probability block.
QUERY_ROWS_PER_BLOCK = 256


def query_weights(config: PyramidConfig, query_positions: torch.Tensor, window_start: int,
                  window: int) -> torch.Tensor:
    """Weight of each recent query ([R] positions in [window_start, window_start + window))."""
    low, high = config.query_weight_min, config.query_weight_max
    if window <= 1:
        return torch.full(query_positions.shape, high, dtype=torch.float32,
                          device=query_positions.device)
    progress = (query_positions - window_start).to(torch.float32) / (window - 1)
    return low + (high - low) * progress


def recent_attention_scores(q: torch.Tensor, query_positions: torch.Tensor, weights: torch.Tensor,
                            k: torch.Tensor, key_positions: torch.Tensor,
                            sliding_window: int | None = None) -> torch.Tensor:
    """Weighted, head-averaged attention that recent queries pay to each key.

    q: [R, H, D] (RoPE applied); query_positions, weights: [R];
    k: [S, Hkv, D] (RoPE applied); key_positions: [S]. Returns [S] float32.
    A query only sees keys at or before its own position (and inside the
    sliding window, for models that have one), exactly as in the model.
    """
    if cpu_kernels.attention_scores_fits(q, k):
        return cpu_kernels.kernels().attention_scores(
            q.contiguous(), query_positions.to(torch.int64).contiguous(),
            weights.to(torch.float32).contiguous(), k.contiguous(),
            key_positions.to(torch.int64).contiguous(), sliding_window or 0)
    return recent_attention_scores_torch(q, query_positions, weights, k, key_positions,
                                         sliding_window)


def recent_attention_scores_torch(q: torch.Tensor, query_positions: torch.Tensor,
                                  weights: torch.Tensor, k: torch.Tensor, key_positions: torch.Tensor,
                                  sliding_window: int | None = None) -> torch.Tensor:
    """``recent_attention_scores`` in torch's ops (any device)."""
    num_queries, num_heads, head_dim = q.shape
    num_keys, num_kv_heads = k.shape[0], k.shape[1]
    group = num_heads // num_kv_heads
    keys = k.to(torch.float32).permute(1, 2, 0).contiguous()  # [Hkv, D, S]
    scores = torch.zeros(num_keys, dtype=torch.float32, device=k.device)
    for start in range(0, num_queries, QUERY_ROWS_PER_BLOCK):
        rows = slice(start, start + QUERY_ROWS_PER_BLOCK)
        block = q[rows].to(torch.float32) * head_dim ** -0.5
        count = block.shape[0]
        # Query head h reads KV head h // G: group the G heads of each KV head together.
        grouped = block.reshape(count, num_kv_heads, group, head_dim).permute(1, 0, 2, 3)
        logits = grouped.reshape(num_kv_heads, count * group, head_dim) @ keys  # [Hkv, R*G, S]
        visible = visibility_mask(query_positions[rows], key_positions, sliding_window)  # [R, S]
        if not bool(visible.all()):
            logits.view(num_kv_heads, count, group, num_keys).masked_fill_(
                ~visible[None, :, None, :], float("-inf"))
        probabilities = logits.softmax(dim=-1).view(-1, num_keys)  # rows ordered (Hkv, R, G)
        # Weighted sum over queries and mean over all H heads, as one matrix-vector product.
        row_weights = weights[rows].to(torch.float32)[None, :, None] / num_heads
        scores += row_weights.expand(num_kv_heads, count, group).reshape(-1) @ probabilities
    return scores


def top_candidates(scores: torch.Tensor, candidates: torch.Tensor, count: int) -> torch.Tensor:
    """Indices of the ``count`` best-scored candidates (bool mask [S]); ties go to the earlier token.

    A stable sort makes the choice deterministic whatever the backend's topk does with ties.
    """
    ranked = scores.masked_fill(~candidates, float("-inf"))
    order = torch.sort(ranked, descending=True, stable=True).indices
    return order[:min(count, int(candidates.sum()))]
