"""Where each of baton's parameters lies in a family's checkpoint.

baton's parameters carry Hugging Face's names, one matrix per projection. Phi-3's
checkpoints store some of them fused: ``self_attn.qkv_proj`` holds q, k and v one above
the other, ``mlp.gate_up_proj`` gate then up. baton keeps them apart (``FusedLinear``
joins them again in memory for its matmuls, as it does for every family), so loading
reads each projection's rows of the fused tensor and saving stacks them back.
"""

from __future__ import annotations

from dataclasses import dataclass
from operator import itemgetter

import torch

from baton.model.config import ModelConfig

# family -> {fused tensor: the projections it stacks, top to bottom}
FUSED_PROJECTIONS = {
    "phi3": {"self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
             "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj")},
}


@dataclass(frozen=True)
class TensorSlice:
    """Rows ``start:end`` of the checkpoint's tensor ``name`` (all of it when ``end`` is None)."""

    name: str
    start: int = 0
    end: int | None = None


def checkpoint_source(config: ModelConfig, parameter: str) -> TensorSlice:
    """The checkpoint tensor (and rows) that holds baton's parameter ``parameter``."""
    fused = FUSED_PROJECTIONS.get(config.family, {})
    layer_prefix, _, local = parameter.partition(".layers.")
    if not local:
        return TensorSlice(parameter)
    index, _, inner = local.partition(".")
    projection, _, kind = inner.rpartition(".")  # "self_attn.q_proj", "weight"
    for fused_name, parts in fused.items():
        if projection in parts:
            sizes = _row_counts(config, parts)
            position = parts.index(projection)
            start = sum(sizes[:position])
            return TensorSlice(f"{layer_prefix}.layers.{index}.{fused_name}.{kind}", start,
                               start + sizes[position])
    return TensorSlice(parameter)


def checkpoint_tensors(config: ModelConfig, parameters: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """baton's parameters (name -> tensor) under the checkpoint's names, fused where the
    family's checkpoints fuse them."""
    pieces: dict[str, list[tuple[int, torch.Tensor]]] = {}
    for name, tensor in parameters.items():
        source = checkpoint_source(config, name)
        pieces.setdefault(source.name, []).append((source.start, tensor))
    return {name: torch.cat([tensor for _, tensor in sorted(parts, key=itemgetter(0))])
            if len(parts) > 1 else parts[0][1] for name, parts in pieces.items()}


def _row_counts(config: ModelConfig, parts: tuple[str, ...]) -> list[int]:
    rows = {"self_attn.q_proj": config.num_attention_heads * config.head_dim,
            "self_attn.k_proj": config.num_key_value_heads * config.head_dim,
            "self_attn.v_proj": config.num_key_value_heads * config.head_dim,
            "mlp.gate_proj": config.intermediate_size, "mlp.up_proj": config.intermediate_size}
    return [rows[part] for part in parts]
