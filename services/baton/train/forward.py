"""A batched, differentiable forward for training over the inference model's own modules.

``CausalLM.forward`` is inference-only (``torch.inference_mode`` and per-sequence
KV caches). Training needs gradients and many equal-length sequences at once, so
this runs the SAME submodules — ``embed_tokens``, each layer's norms,
``self_attn.project`` (q/k/v + RoPE), causal SDPA, ``o_proj``, ``mlp``, the final
norm and ``lm_head`` — over a [B, T] batch that starts at position 0. A model
trained here is therefore exactly the model the runtime serves.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from baton.model.llama import CausalLM


def hidden_states(model: CausalLM, token_ids: torch.Tensor) -> torch.Tensor:
    """token_ids: [B, T] (each row starts at position 0) -> final hidden states [B, T, hidden]."""
    batch, length = token_ids.shape
    config = model.config
    hidden = model.model.embed_tokens(token_ids).reshape(batch * length, -1)  # [B*T, hidden]
    positions = torch.arange(length, device=token_ids.device).repeat(batch)  # [B*T]
    cos, sin = model.rotary.cos_sin(positions, hidden.dtype)  # [B*T, 1, D]
    grouped = config.num_attention_heads != config.num_key_value_heads
    for layer in model.model.layers:
        attn = layer.self_attn
        q, k, v = attn.project(layer.input_layernorm(hidden), cos, sin)  # [B*T, H|Hkv, D]
        # SDPA wants [B, heads, T, D].
        q, k, v = (x.view(batch, length, x.shape[1], x.shape[2]).transpose(1, 2) for x in (q, k, v))
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=grouped)
        hidden = hidden + attn.o_proj(out.transpose(1, 2).reshape(batch * length, -1))
        hidden = hidden + layer.feed_forward(layer.post_attention_layernorm(hidden))
    return model.model.norm(hidden).view(batch, length, -1)


def next_token_loss(model: CausalLM, windows: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy (nats/token) of predicting windows[:, 1:] from windows[:, :-1].

    windows: [B, T + 1] token ids.
    """
    inputs, targets = windows[:, :-1], windows[:, 1:]
    logits = model.lm_head(hidden_states(model, inputs))  # [B, T, vocab]
    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1))
