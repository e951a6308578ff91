"""Attention of a run of new tokens over keys that may include a cached prefix.

The one primitive that KV-Runahead's ranks, SARATHI's chunks, decode steps and
PyramidInfer-pruned caches all need. The mask is built from absolute positions
(a key is visible when its position is not after the query's), which equals the
bottom-right-aligned causal mask whenever the keys are a prefix followed by the
queries' own tokens — and stays right when the prefix has been pruned, because
pruning keeps original positions.

Gemma 2's soft-capped scores (cap * tanh(scores / cap) before the softmax) are beyond the
fused kernels: its layers take an explicit torch path, ``_soft_capped``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from baton.kernels import cpu as cpu_kernels


def visibility_mask(query_positions: torch.Tensor, key_positions: torch.Tensor,
                    sliding_window: int | None) -> torch.Tensor:
    """[T, S] bool: may query t see key s."""
    delta = query_positions[:, None] - key_positions[None, :]
    visible = delta >= 0
    if sliding_window is not None:
        visible &= delta < sliding_window
    return visible


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, query_positions: torch.Tensor,
           key_positions: torch.Tensor, sliding_window: int | None = None,
           softcap: float | None = None) -> torch.Tensor:
    """Causal attention of one sequence's new tokens.

    q: [T, H, D]; k, v: [S, Hkv, D] with S >= T, the last T keys being the
    queries' own tokens; positions: [T] and [S]. Returns [T, H, D].
    """
    num_queries, num_keys = q.shape[0], k.shape[0]
    if softcap is not None:
        mask = visibility_mask(query_positions, key_positions, sliding_window)
        return _attend_grouped(q, k, v, mask, softcap)
    window_matters = sliding_window is not None and num_keys > sliding_window
    if (not window_matters and cpu_kernels.causal_attention_fits(q, k)
            and (num_queries == num_keys or _prefix_then_own(query_positions, key_positions))):
        # A whole prompt, or a slice over a prefix it sees whole: our CPU kernel (several
        # times torch's fused kernel on small heads, docs/runtime.md), reading q, k and v in
        # place when they are views of the fused projection.
        return cpu_kernels.kernels().causal_attention(
            cpu_kernels.token_rows(q), cpu_kernels.token_rows(k), cpu_kernels.token_rows(v))
    if num_queries != num_keys and num_queries <= MAX_GROUPED_QUERIES:
        # One new token sees every cached key (they all come before it): no mask to build.
        sees_all = num_queries == 1 and not window_matters
        mask = None if sees_all else visibility_mask(query_positions, key_positions, sliding_window)
        return _attend_grouped(q, k, v, mask)
    # [1, heads, len, D]: CPU SDPA takes its fused kernels only for 4-D inputs (3-D falls back
    # to the slow math path).
    qh = q.transpose(0, 1)[None]
    if num_queries == num_keys and not window_matters and q.device.type == "cpu":
        # A whole prompt: the fused causal kernel reads the KV heads in place (enable_gqa,
        # faster on a CPU than copying them out to every query head; on CUDA the flash
        # kernels take equal head counts, so the copy stays there).
        out = F.scaled_dot_product_attention(qh, k.transpose(0, 1)[None], v.transpose(0, 1)[None],
                                             is_causal=True, enable_gqa=True)
        return out[0].transpose(0, 1)
    kh = expand_kv_heads(k, q.shape[1]).transpose(0, 1)[None]
    vh = expand_kv_heads(v, q.shape[1]).transpose(0, 1)[None]
    if num_queries == num_keys and not window_matters:
        out = F.scaled_dot_product_attention(qh, kh, vh, is_causal=True)
    elif (not window_matters and _SPLIT_KERNEL is not None and q.device.type == "cpu"
          and _prefix_then_own(query_positions, key_positions)):
        out = _attend_prefix_then_own(qh, kh, vh, num_keys - num_queries)
    else:
        mask = visibility_mask(query_positions, key_positions, sliding_window)
        out = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask)
    return out[0].transpose(0, 1)


# Up to this many new tokens over a cached prefix (a decode, a SARATHI chunk, a short
# chain slice), GQA groups the query heads instead of copying K/V to every head (faster
# on a CPU up to here); beyond that the split kernel wins.
MAX_GROUPED_QUERIES = 512


def _attend_grouped(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                    mask: torch.Tensor | None, softcap: float | None = None) -> torch.Tensor:
    """GQA without copying K/V: the G query heads that share a KV head become G*T query
    rows of that head, all under the same [T, S] mask (None: every key visible).
    q: [T, H, D]; k, v: [S, Hkv, D]."""
    num_queries, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    groups = num_heads // num_kv_heads
    # rows of KV head h: (group g, query t) -> g * T + t
    grouped = q.view(num_queries, num_kv_heads, groups, head_dim).permute(1, 2, 0, 3)
    grouped = grouped.reshape(1, num_kv_heads, groups * num_queries, head_dim)
    mask = None if mask is None else mask.repeat(groups, 1)
    keys, values = k.transpose(0, 1)[None], v.transpose(0, 1)[None]
    if softcap is not None:
        bias = None if mask is None else torch.zeros(mask.shape, dtype=q.dtype, device=q.device
                                                     ).masked_fill_(~mask, float("-inf"))
        out = _soft_capped(grouped, keys, values, bias, softcap)
    else:
        out = F.scaled_dot_product_attention(grouped, keys, values, attn_mask=mask)
    out = out.view(num_kv_heads, groups, num_queries, head_dim).permute(2, 0, 1, 3)
    return out.reshape(num_queries, num_heads, head_dim)


# CPU's fused kernel, called directly because it also returns each row's log-sum-exp,
# which merging two partial attentions needs (the public SDPA does not return it).
_SPLIT_KERNEL = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)


def _prefix_then_own(query_positions: torch.Tensor, key_positions: torch.Tensor) -> bool:
    """Do the keys end with the queries' own tokens, after a prefix that every query sees?

    True for a chain rank's or a chunk's keys (prefix 0..b, then its slice), also when
    the prefix was pruned: pruning keeps positions, all before the new tokens.
    """
    num_queries, num_keys = query_positions.shape[0], key_positions.shape[0]
    if num_queries == 0 or num_queries >= num_keys:
        return False
    own = key_positions[num_keys - num_queries:]
    return bool(torch.equal(own, query_positions)
                and key_positions[:num_keys - num_queries].max() <= query_positions.min()
                and (num_queries == 1 or bool((own[1:] > own[:-1]).all())))


def _attend_prefix_then_own(qh: torch.Tensor, kh: torch.Tensor, vh: torch.Tensor,
                            prefix: int) -> torch.Tensor:
    """Bottom-right causal attention as two fused calls merged by their log-sum-exps.

    An explicit [T, S] mask costs its materialisation and makes the kernel visit every
    block; here the prefix is attended without a mask and the own slice with
    ``is_causal``, which skips the blocks above the diagonal. Inputs [1, H, len, D];
    returns [1, H, T, D].
    """
    out_prefix, lse_prefix = _SPLIT_KERNEL(qh, kh[:, :, :prefix], vh[:, :, :prefix])[:2]
    out_own, lse_own = _SPLIT_KERNEL(qh, kh[:, :, prefix:], vh[:, :, prefix:], is_causal=True)[:2]
    # softmax over both key sets = a weighted mean of the two partial outputs, the weight
    # of the prefix part being exp(lse_prefix) / (exp(lse_prefix) + exp(lse_own)).
    weight = torch.sigmoid(lse_prefix.float() - lse_own.float())[..., None]
    return torch.lerp(out_own.float(), out_prefix.float(), weight).to(qh.dtype)


def expand_kv_heads(x: torch.Tensor, num_heads: int) -> torch.Tensor:
    """[S, Hkv, D] -> [S, H, D]: each KV head repeated for its group of query heads (GQA/MQA)."""
    length, num_kv_heads, head_dim = x.shape
    groups = num_heads // num_kv_heads
    if groups == 1:
        return x
    # expand + reshape copies once; repeat_interleave is several times slower on CPU.
    return x[:, :, None, :].expand(length, num_kv_heads, groups, head_dim).reshape(
        length, num_heads, head_dim)


def decode_attention_bias(query_positions: torch.Tensor, key_positions: torch.Tensor | None,
                          lengths: torch.Tensor, span: int, sliding_window: int | None,
                          dtype: torch.dtype) -> torch.Tensor:
    """Additive mask [B, 1, 1, S] of a padded decode batch: 0 where row b may see key s (one
    of its ``lengths[b]`` valid keys, inside the window), -inf elsewhere. Built once and
    reused by every layer whose tables have the same shape (no pruning, no window)."""
    visible = torch.arange(span, device=lengths.device)[None, :] < lengths[:, None]  # [B, S]
    if sliding_window is not None:
        visible &= (query_positions[:, None] - key_positions) < sliding_window
    bias = torch.zeros(visible.shape, dtype=dtype, device=visible.device)
    return bias.masked_fill_(~visible, float("-inf"))[:, None, None, :]


def attend_decode_batch(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                        bias: torch.Tensor, softcap: float | None = None) -> torch.Tensor:
    """One new token for each of B sequences, attended in one padded kernel call.

    q: [B, H, D]; k, v: [B, S, Hkv, D] padded; bias: ``decode_attention_bias``.
    Returns [B, H, D].
    """
    batch, _, num_kv_heads, head_dim = k.shape
    num_heads = q.shape[1]
    # GQA without copying K/V: the G query heads that share a KV head become G "query
    # rows" of that head (head h reads KV head h // G), so q: [B, Hkv, G, D].
    grouped = q.view(batch, num_kv_heads, num_heads // num_kv_heads, head_dim)
    if softcap is not None:
        out = _soft_capped(grouped, k.transpose(1, 2), v.transpose(1, 2), bias, softcap)
    else:
        out = F.scaled_dot_product_attention(grouped, k.transpose(1, 2), v.transpose(1, 2),
                                             attn_mask=bias)
    return out.reshape(batch, num_heads, head_dim)


def _soft_capped(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor | None,
                 softcap: float) -> torch.Tensor:
    """softmax(cap * tanh(q k^T / sqrt(D) / cap) + bias) v, as transformers' eager attention
    computes it (the softmax in fp32). q: [..., R, D]; k, v: [..., S, D]; bias broadcasts
    to [..., R, S] (-inf where hidden)."""
    scores = torch.matmul(q, k.transpose(-1, -2)) * q.shape[-1] ** -0.5
    scores = torch.tanh(scores / softcap) * softcap
    if bias is not None:
        scores = scores + bias
    weights = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    return torch.matmul(weights, v)
