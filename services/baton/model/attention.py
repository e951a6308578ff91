"""Attention of a run of new tokens over keys that may include a cached prefix.

The one primitive that KV-Runahead's ranks, SARATHI's chunks, decode steps and
PyramidInfer-pruned caches all need. The mask is built from absolute positions
(a key is visible when its position is not after the query's), which equals the
bottom-right-aligned causal mask whenever the keys are a prefix followed by the
queries' own tokens — and stays right when the prefix has been pruned, because
pruning keeps original positions.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def visibility_mask(query_positions: torch.Tensor, key_positions: torch.Tensor,
                    sliding_window: int | None) -> torch.Tensor:
    """[T, S] bool: may query t see key s."""
    delta = query_positions[:, None] - key_positions[None, :]
    visible = delta >= 0
    if sliding_window is not None:
        visible &= delta < sliding_window
    return visible


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, query_positions: torch.Tensor,
           key_positions: torch.Tensor, sliding_window: int | None = None) -> torch.Tensor:
    """Causal attention of one sequence's new tokens.

    q: [T, H, D]; k, v: [S, Hkv, D] with S >= T, the last T keys being the
    queries' own tokens; positions: [T] and [S]. Returns [T, H, D].
    """
    num_queries, num_keys = q.shape[0], k.shape[0]
    # [1, heads, len, D]: CPU SDPA takes its fused kernels only for 4-D inputs with equal
    # head counts (3-D or enable_gqa fall back to the slow math path: 6-10x at 2k tokens).
    qh = q.transpose(0, 1)[None]
    kh = expand_kv_heads(k, q.shape[1]).transpose(0, 1)[None]
    vh = expand_kv_heads(v, q.shape[1]).transpose(0, 1)[None]
    window_matters = sliding_window is not None and num_keys > sliding_window
    if num_queries == num_keys and not window_matters:
        out = F.scaled_dot_product_attention(qh, kh, vh, is_causal=True)
    elif num_queries == 1 and not window_matters:
        out = F.scaled_dot_product_attention(qh, kh, vh)
    else:
        mask = visibility_mask(query_positions, key_positions, sliding_window)
        out = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask)
    return out[0].transpose(0, 1)


def expand_kv_heads(x: torch.Tensor, num_heads: int) -> torch.Tensor:
    """[S, Hkv, D] -> [S, H, D]: each KV head repeated for its group of query heads (GQA/MQA)."""
    length, num_kv_heads, head_dim = x.shape
    groups = num_heads // num_kv_heads
    if groups == 1:
        return x
    # expand + reshape copies once; repeat_interleave is several times slower on CPU.
    return x[:, :, None, :].expand(length, num_kv_heads, groups, head_dim).reshape(
        length, num_heads, head_dim)


def attend_decode_batch(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                        query_positions: torch.Tensor, key_positions: torch.Tensor,
                        lengths: torch.Tensor, sliding_window: int | None = None) -> torch.Tensor:
    """One new token for each of B sequences, attended in one padded kernel call.

    q: [B, H, D]; k, v: [B, S, Hkv, D] padded; key_positions: [B, S]; lengths: [B]
    valid keys per row. Returns [B, H, D].
    """
    batch, span, num_kv_heads, head_dim = k.shape
    num_heads = q.shape[1]
    mask = torch.arange(span, device=q.device)[None, :] < lengths[:, None]  # [B, S]
    if sliding_window is not None:
        mask &= (query_positions[:, None] - key_positions) < sliding_window
    # GQA without copying K/V: the G query heads that share a KV head become G "query
    # rows" of that head (head h reads KV head h // G), so q: [B, Hkv, G, D].
    grouped = q.view(batch, num_kv_heads, num_heads // num_kv_heads, head_dim)
    out = F.scaled_dot_product_attention(grouped, k.transpose(1, 2), v.transpose(1, 2),
                                         attn_mask=mask[:, None, None, :])
    return out.reshape(batch, num_heads, head_dim)
