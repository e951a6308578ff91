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
    qh, kh, vh = q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1)  # [heads, len, D]
    gqa = q.shape[1] != k.shape[1]
    window_matters = sliding_window is not None and num_keys > sliding_window
    if num_queries == num_keys and not window_matters:
        out = F.scaled_dot_product_attention(qh, kh, vh, is_causal=True, enable_gqa=gqa)
    elif num_queries == 1 and not window_matters:
        out = F.scaled_dot_product_attention(qh, kh, vh, enable_gqa=gqa)
    else:
        mask = visibility_mask(query_positions, key_positions, sliding_window)
        out = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask, enable_gqa=gqa)
    return out.transpose(0, 1)


def attend_decode_batch(q: torch.Tensor, keys: list[torch.Tensor], values: list[torch.Tensor],
                        query_positions: torch.Tensor, key_positions: list[torch.Tensor],
                        sliding_window: int | None = None) -> torch.Tensor:
    """One new token for each of B sequences, attended in one padded kernel call.

    q: [B, H, D]; keys[b], values[b]: [S_b, Hkv, D]. Returns [B, H, D].
    """
    batch = q.shape[0]
    longest = max(k.shape[0] for k in keys)
    num_kv_heads, head_dim = keys[0].shape[1], keys[0].shape[2]
    k_pad = q.new_zeros(batch, longest, num_kv_heads, head_dim)
    v_pad = q.new_zeros(batch, longest, num_kv_heads, head_dim)
    mask = torch.zeros(batch, 1, 1, longest, dtype=torch.bool, device=q.device)
    for b, (k, v) in enumerate(zip(keys, values)):
        length = k.shape[0]
        k_pad[b, :length] = k
        v_pad[b, :length] = v
        if sliding_window is None:
            mask[b, 0, 0, :length] = True
        else:
            mask[b, 0, 0, :length] = visibility_mask(query_positions[b:b + 1], key_positions[b],
                                                     sliding_window)[0]
    out = F.scaled_dot_product_attention(
        q[:, :, None, :], k_pad.transpose(1, 2), v_pad.transpose(1, 2), attn_mask=mask,
        enable_gqa=q.shape[1] != num_kv_heads)
    return out[:, :, 0, :]
