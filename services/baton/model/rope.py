"""Rotary position embeddings, with the Llama 3 and linear scaling variants.

Follows the Hugging Face definition exactly (``rotate_half`` convention,
frequencies in fp32) so that logits match ``transformers`` bit for bit in fp32.
"""

from __future__ import annotations

import math

import torch

from baton.model.config import ModelConfig


def inverse_frequencies(config: ModelConfig) -> torch.Tensor:
    """inv_freq: [head_dim // 2] in fp32, scaled as the checkpoint's rope_type says."""
    rope = config.rope
    dim = config.head_dim
    base = float(rope.get("rope_theta", 10000.0))
    inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    rope_type = rope.get("rope_type", "default")
    if rope_type == "linear":
        return inv_freq / float(rope["factor"])
    if rope_type == "llama3":
        return _llama3_scaled(inv_freq, rope)
    return inv_freq


def _llama3_scaled(inv_freq: torch.Tensor, rope: dict) -> torch.Tensor:
    # Llama 3.1: long wavelengths are slowed by `factor`, short ones kept, and the
    # band between is interpolated smoothly.
    factor = float(rope["factor"])
    low_freq_factor = float(rope["low_freq_factor"])
    high_freq_factor = float(rope["high_freq_factor"])
    old_context = float(rope["original_max_position_embeddings"])
    low_freq_wavelen = old_context / low_freq_factor
    high_freq_wavelen = old_context / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) & ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


class RotaryEmbedding(torch.nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.register_buffer("inv_freq", inverse_frequencies(config), persistent=False)

    def _apply(self, fn, recurse: bool = True):
        """The frequencies follow the model to its device but stay exact fp32 whatever dtype
        it is cast to (rounded to bf16 they would turn position p's angle by up to p * 2^-9
        rad), and a model made on the meta device gets them when it is materialised."""
        super()._apply(fn, recurse)
        device = self.inv_freq.device
        if device.type != "meta":
            with torch.device("cpu"):
                self.inv_freq = inverse_frequencies(self.config).to(device)
        return self

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin: [T, 1, head_dim] for absolute positions [T] (broadcast over heads)."""
        freqs = positions.to(torch.float32)[:, None] * self.inv_freq.to(positions.device)[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(dtype)[:, None, :], emb.sin().to(dtype)[:, None, :]


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [T, heads, head_dim] rotated by its tokens' angles."""
    return x * cos + rotate_half(x) * sin
