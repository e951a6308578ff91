"""Tiny random models and prompts for the PyramidInfer tests (built in milliseconds, no files)."""

from __future__ import annotations

import math

import pytest
import torch
from baton.model import CausalLM
from hf_reference import tiny_config

PROMPT_LENGTH = 320  # recent window 64 + 4 sinks = 68 mandatory tokens, above min_context 64


def build_model(num_heads: int = 4, num_kv_heads: int = 2, num_layers: int = 4,
                seed: int = 0) -> CausalLM:
    torch.manual_seed(seed)
    config = tiny_config("llama3", num_attention_heads=num_heads, num_key_value_heads=num_kv_heads,
                         num_hidden_layers=num_layers)
    model = CausalLM(config)
    # Sharper random attention than the default init, so tokens' scores differ clearly.
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.q_proj.weight.mul_(4.0)
            layer.self_attn.k_proj.weight.mul_(4.0)
    return model.eval()


@pytest.fixture(scope="module")
def model() -> CausalLM:
    return build_model()


@pytest.fixture(scope="module")
def prompt() -> torch.Tensor:
    generator = torch.Generator().manual_seed(1)
    return torch.randint(0, 256, (PROMPT_LENGTH,), generator=generator)


def hand_decode(model, token, position, layers):
    """One decode step with attention written out over exactly the cached (selected) K, V."""
    config = model.config
    group = config.num_attention_heads // config.num_key_value_heads
    with torch.no_grad():
        x = model.model.embed_tokens.weight[token][None]  # [1, hidden]
        cos, sin = model.rotary.cos_sin(torch.tensor([position]), x.dtype)
        for index, layer in enumerate(model.model.layers):
            attn = layer.self_attn
            q, k, v = attn.project(layer.input_layernorm(x), cos, sin)  # [1, H or Hkv, D]
            keys = torch.cat([layers[index].k, k])
            values = torch.cat([layers[index].v, v])
            heads = []
            for head in range(config.num_attention_heads):
                logits = keys[:, head // group] @ q[0, head] / math.sqrt(config.head_dim)
                heads.append(torch.softmax(logits, 0) @ values[:, head // group])
            x = x + attn.o_proj(torch.cat(heads)[None])
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        return model.lm_head(model.model.norm(x))[0]
