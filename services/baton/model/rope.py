"""Rotary position embeddings and their scalings: linear, Llama 3, YaRN, dynamic NTK and
LongRoPE, over all of each head or (``partial_rotary_factor``) its first dimensions.

Follows transformers' ``modeling_rope_utils`` exactly (``rotate_half`` convention,
frequencies in fp32, the same Python-float arithmetic for bases and factors) so that logits
match in fp32. A scaling gives inverse frequencies and an attention factor that multiplies
cos and sin (YaRN's mscale, LongRoPE's); both are fixed for the life of the model, so every
key in a KV cache is rotated as the keys after it are:

* dynamic NTK: transformers rescales the base only once a forward's sequence is longer
  than the checkpoint's ``max_position_embeddings``, and then for every position of that
  forward, which no KV cache can follow (its older keys would need rotating anew). baton
  never serves past ``max_position_embeddings`` (``ModelConfig.cap_context``, the prompt
  checks), and below it the frequencies are transformers' own unscaled ones, computed by
  its formula at that length: exact for every sequence served.
* LongRoPE: transformers picks the long factors for a forward whose sequence is longer
  than ``original_max_position_embeddings``, else the short ones. baton picks once, by the
  context it serves (as vLLM does): the long factors when that context exceeds the original
  one, else the short ones. Exact for every sequence when the served context is within the
  original one, and for every sequence longer than it otherwise; a shorter sequence on a
  long-context deployment gets the long factors, where transformers would use the short.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from baton.model.config import ModelConfig


def rotary_dim(rope: dict[str, Any], head_dim: int) -> int:
    """How many leading dimensions of each head are rotated (the rest pass unchanged)."""
    return int(head_dim * rope.get("partial_rotary_factor", 1.0))


def inverse_frequencies(config: ModelConfig, rope: dict[str, Any] | None = None) -> torch.Tensor:
    """inv_freq: [rotary_dim // 2] in fp32, scaled as the rope parameters say (the model's
    global ones unless ``rope`` is given)."""
    return rope_frequencies(config, config.rope if rope is None else rope)[0]


def rope_frequencies(config: ModelConfig, rope: dict[str, Any]) -> tuple[torch.Tensor, float]:
    """(inv_freq [rotary_dim // 2] fp32, attention factor that scales cos and sin)."""
    dim = rotary_dim(rope, config.head_dim)
    base = float(rope.get("rope_theta", 10000.0))
    rope_type = rope.get("rope_type", "default")
    if rope_type == "dynamic":
        return _dynamic_ntk(rope, dim, base, config.checkpoint_max_position_embeddings), 1.0
    if rope_type == "yarn":
        return _yarn(rope, dim, base, config.checkpoint_max_position_embeddings)
    if rope_type == "longrope":
        return _longrope(rope, dim, base, config)
    inv_freq = _unscaled(dim, base)
    if rope_type == "linear":
        return inv_freq / float(rope["factor"]), 1.0
    if rope_type == "llama3":
        return _llama3_scaled(inv_freq, rope), 1.0
    return inv_freq, 1.0


def _unscaled(dim: int, base: float) -> torch.Tensor:
    return 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))


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


def _dynamic_ntk(rope: dict, dim: int, base: float, max_position_embeddings: int) -> torch.Tensor:
    # The base stretched for a sequence of max_position_embeddings tokens, the longest
    # served (see the module's note): (factor * L / L - (factor - 1)) is 1 up to rounding,
    # and that rounding is transformers' too.
    factor = rope["factor"]
    length = max_position_embeddings
    base = base * ((factor * length / max_position_embeddings) - (factor - 1)) ** (dim / (dim - 2))
    return _unscaled(dim, base)


def _yarn(rope: dict, dim: int, base: float, max_position_embeddings: int) -> tuple[torch.Tensor, float]:
    # YaRN: frequencies that turn less than beta_slow times over the original context are
    # interpolated by `factor`, those turning more than beta_fast times kept, a linear ramp
    # between; cos and sin scaled by mscale (0.1 ln(factor) + 1, or DeepSeek's ratio).
    original = rope["original_max_position_embeddings"]
    factor = rope.get("factor") or max_position_embeddings / original
    attention_factor = rope.get("attention_factor")
    mscale, mscale_all_dim = rope.get("mscale"), rope.get("mscale_all_dim")

    def get_mscale(scale: float, multiplier: float = 1) -> float:
        return 1.0 if scale <= 1 else 0.1 * multiplier * math.log(scale) + 1.0

    if attention_factor is None:
        if mscale and mscale_all_dim:
            attention_factor = float(get_mscale(factor, mscale) / get_mscale(factor, mscale_all_dim))
        else:
            attention_factor = get_mscale(factor)
    beta_fast = rope.get("beta_fast") or 32
    beta_slow = rope.get("beta_slow") or 1

    def correction_dim(num_rotations: float) -> float:
        return (dim * math.log(original / (num_rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if rope.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # no zero-width ramp
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2).float() / dim)
    extrapolation = 1 - ramp  # the share of each frequency kept as trained
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation
    return inv_freq, attention_factor


def _longrope(rope: dict, dim: int, base: float, config: ModelConfig) -> tuple[torch.Tensor, float]:
    original = rope["original_max_position_embeddings"]
    factor = rope.get("factor") or config.checkpoint_max_position_embeddings / original
    attention_factor = rope.get("attention_factor")
    if attention_factor is None:
        attention_factor = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    # one set for the whole served context (the module's note)
    long = config.max_position_embeddings > original
    factors = torch.tensor(rope["long_factor" if long else "short_factor"], dtype=torch.float32)
    shape = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
    return 1.0 / (factors * base ** shape), attention_factor


class RotaryEmbedding(torch.nn.Module):
    """cos and sin of a set of rope parameters (the model's, or Gemma 3's local layers')."""

    def __init__(self, config: ModelConfig, rope: dict[str, Any] | None = None) -> None:
        super().__init__()
        self.config = config
        self.rope = config.rope if rope is None else rope
        inv_freq, self.attention_factor = rope_frequencies(config, self.rope)
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def _apply(self, fn, recurse: bool = True):
        """The frequencies follow the model to its device but stay exact fp32 whatever dtype
        it is cast to (rounded to bf16 they would turn position p's angle by up to p * 2^-9
        rad), and a model made on the meta device gets them when it is materialised."""
        super()._apply(fn, recurse)
        device = self.inv_freq.device
        if device.type != "meta":
            with torch.device("cpu"):
                self.inv_freq = rope_frequencies(self.config, self.rope)[0].to(device)
        return self

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin: [T, 1, rotary_dim] for absolute positions [T] (broadcast over heads)."""
        freqs = positions.to(torch.float32)[:, None] * self.inv_freq.to(positions.device)[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos(), emb.sin()
        if self.attention_factor != 1.0:
            cos, sin = cos * self.attention_factor, sin * self.attention_factor
        return cos.to(dtype)[:, None, :], sin.to(dtype)[:, None, :]


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [T, heads, head_dim] rotated by its tokens' angles: its first cos.shape[-1]
    dimensions, the rest passed through (partial rotary)."""
    dim = cos.shape[-1]
    if dim == x.shape[-1]:
        return x * cos + rotate_half(x) * sin
    rotated = x[..., :dim]
    return torch.cat((rotated * cos + rotate_half(rotated) * sin, x[..., dim:]), dim=-1)
