"""Quantized weights back to the model's dtype: the math of each layout, on tensors alone.

Each function follows the reference dequantization of its format step by step, in the
dtype that reference computes in, so that the loaded weights are the ones the checkpoint's
authors evaluated:

* float8 with block scales (``quant_method: fp8``, DeepSeek-V3 / Qwen3-FP8): transformers'
  ``Fp8Dequantize`` and DeepSeek's ``weight_dequant``: ``weight * weight_scale_inv`` in fp32,
  one scale per ``block_rows x block_cols`` tile, partial tiles at the right and bottom edges.
* float8 in compressed-tensors: its ``dequantize``: ``weight.to(scale.dtype) * scale``.

It returns ``[out_features, in_features]``, the orientation of a Linear's weight.
Scales that do not fit raise ValueError, which the caller turns into a CheckpointError.
"""

from __future__ import annotations

import torch


def dequantize_float8(weight: torch.Tensor, scale: torch.Tensor, block_size: tuple[int, int] | None,
                      compute_dtype: torch.dtype | None, dtype: torch.dtype) -> torch.Tensor:
    """``weight`` [N, K] in float8 times its scales: one scale (per tensor), ``[N, 1]`` (per
    output channel), or a ``[ceil(N / b0), ceil(K / b1)]`` grid for ``block_size`` (b0, b1).
    ``compute_dtype`` None: the scales' dtype."""
    if weight.dim() != 2:
        raise ValueError(f"is a float8 weight of shape {tuple(weight.shape)}, expected a matrix")
    rows, cols = weight.shape
    if scale.numel() == 1:
        tile = (rows, cols)
    elif tuple(scale.shape) in ((rows, 1), (rows,)):
        tile = (1, cols)
    elif block_size is not None:
        tile = tuple(block_size)
    else:
        raise ValueError(f"has scales of shape {tuple(scale.shape)}, which fit neither one per "
                         f"tensor nor one per output channel of a {rows}x{cols} weight "
                         "(and the quantization_config gives no block size)")
    grid = (-(-rows // tile[0]), -(-cols // tile[1]))
    if scale.numel() != grid[0] * grid[1] or (scale.dim() == 2 and tuple(scale.shape) != grid):
        raise ValueError(f"has scales of shape {tuple(scale.shape)}; blocks of {tile[0]}x{tile[1]} "
                         f"over a {rows}x{cols} weight take {grid[0]}x{grid[1]}")
    compute_dtype = compute_dtype or scale.dtype
    scale = scale.reshape(grid).to(compute_dtype)
    # one scale per element: tiles repeated, and cut where the last tile overhangs the weight
    scale = scale.repeat_interleave(tile[0], dim=0)[:rows].repeat_interleave(tile[1], dim=1)[:, :cols]
    return (weight.to(compute_dtype) * scale).to(dtype)

