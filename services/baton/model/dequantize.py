"""Quantized weights back to the model's dtype: the math of each layout, on tensors alone.

Each function follows the reference dequantization of its format step by step, in the
dtype that reference computes in, so that the loaded weights are the ones the checkpoint's
authors evaluated:

* float8 with block scales (``quant_method: fp8``, DeepSeek-V3 / Qwen3-FP8): transformers'
  ``Fp8Dequantize`` and DeepSeek's ``weight_dequant``: ``weight * weight_scale_inv`` in fp32,
  one scale per ``block_rows x block_cols`` tile, partial tiles at the right and bottom edges.
* float8 in compressed-tensors: its ``dequantize``: ``weight.to(scale.dtype) * scale``.
* AWQ (AutoAWQ's GEMM layout): ``dequantize_gemm``: ``(q - zero) * scale`` in the scales' dtype.
* GPTQ (AutoGPTQ / GPTQModel): ``scale[g_idx] * (q - zero[g_idx])`` in the scales' dtype, the
  stored zeros one less than the real ones in the v1 checkpoint format.

Every function returns ``[out_features, in_features]``, the orientation of a Linear's weight.
Shapes that do not fit raise ValueError, which the caller turns into a CheckpointError.
"""

from __future__ import annotations

import torch

INT4_PER_INT32 = 8
# AutoAWQ packs the 8 columns c..c+7 of a group into one int32 in this order (nibble i holds
# column AWQ_PACK_ORDER[i]); reading nibbles 0..7 then indexing by AWQ_REVERSE_ORDER restores
# c..c+7.
AWQ_PACK_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
AWQ_REVERSE_ORDER = (0, 4, 1, 5, 2, 6, 3, 7)


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


def unpack_int4_columns(packed: torch.Tensor) -> torch.Tensor:
    """int32 [R, C] -> [R, 8 C]: word c's nibble i (bits 4i..4i+3) becomes column 8 c + i."""
    shifts = torch.arange(0, 32, 4, dtype=torch.int32, device=packed.device)
    return torch.bitwise_and(packed[:, :, None] >> shifts, 0xF).reshape(packed.shape[0], -1)


def unpack_int4_rows(packed: torch.Tensor) -> torch.Tensor:
    """int32 [R, C] -> [8 R, C]: word r's nibble i becomes row 8 r + i (GPTQ's qweight)."""
    shifts = torch.arange(0, 32, 4, dtype=torch.int32, device=packed.device)
    return torch.bitwise_and(packed[:, None, :] >> shifts[:, None], 0xF).reshape(-1, packed.shape[1])


def dequantize_awq(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor,
                   group_size: int, dtype: torch.dtype) -> torch.Tensor:
    """AutoAWQ GEMM: qweight int32 [K, N/8], qzeros int32 [K/g, N/8], scales [K/g, N]."""
    in_features, out_features = qweight.shape[0], qweight.shape[1] * INT4_PER_INT32
    group_size = group_size if group_size > 0 else in_features
    num_groups = -(-in_features // group_size)
    _check_shape("qzeros", qzeros, (num_groups, qweight.shape[1]))
    _check_shape("scales", scales, (num_groups, out_features))
    order = torch.arange(out_features, device=qweight.device).view(-1, INT4_PER_INT32)
    order = order[:, list(AWQ_REVERSE_ORDER)].reshape(-1)
    quantized = unpack_int4_columns(qweight)[:, order]
    zeros = unpack_int4_columns(qzeros)[:, order].repeat_interleave(group_size, dim=0)[:in_features]
    scales = scales.repeat_interleave(group_size, dim=0)[:in_features]
    return ((quantized - zeros).to(scales.dtype) * scales).t().to(dtype)


def dequantize_gptq(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor,
                    group_index: torch.Tensor | None, group_size: int, zeros_stored_minus_one: bool,
                    dtype: torch.dtype) -> torch.Tensor:
    """GPTQ: qweight int32 [K/8, N], qzeros int32 [G, N/8], scales [G, N], g_idx [K] (the group
    of each input channel; in order, ``k // group_size``, when the checkpoint has none)."""
    in_features, out_features = qweight.shape[0] * INT4_PER_INT32, qweight.shape[1]
    num_groups = scales.shape[0]
    _check_shape("scales", scales, (num_groups, out_features))
    _check_shape("qzeros", qzeros, (num_groups, out_features // INT4_PER_INT32))
    if group_index is None:
        size = group_size if group_size > 0 else in_features
        group_index = torch.arange(in_features, device=qweight.device) // size
    _check_shape("g_idx", group_index, (in_features,))
    group_index = group_index.long()
    if int(group_index.min()) < 0 or int(group_index.max()) >= num_groups:
        raise ValueError(f"has g_idx outside its {num_groups} groups")
    quantized = unpack_int4_rows(qweight)
    zeros = unpack_int4_columns(qzeros)
    if zeros_stored_minus_one:
        zeros = zeros + 1
    return (scales[group_index] * (quantized - zeros[group_index]).to(scales.dtype)).t().to(dtype)


def _check_shape(name: str, tensor: torch.Tensor, expected: tuple[int, ...]) -> None:
    if tuple(tensor.shape) != expected:
        raise ValueError(f"has {name} of shape {tuple(tensor.shape)}, expected {expected}")
