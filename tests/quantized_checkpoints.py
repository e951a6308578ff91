"""Quantized checkpoints made from random-weight transformers models (tests only).

Each layout quantizes a Linear's weight [out, in] as its tool writes it (tensor names,
dtypes, packing, ``quantization_config``) and returns the dequantized weight computed from
the quantized values themselves, before any packing: a loader that unpacks, orders or scales
them differently loads other weights than the reference model holds.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from hf_reference import save_random_hf_model, tiny_config
from safetensors.torch import load_file, save_file

FLOAT8 = torch.float8_e4m3fn
FLOAT8_MAX = torch.finfo(FLOAT8).max
# what a quantizer replaces: every projection (fused ones too: Phi-3), experts' included; not
# the router (``mlp.gate``), the embeddings nor lm_head
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj",
               "qkv_proj", "gate_up_proj")
AWQ_PACK_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # AutoAWQ's WQLinear_GEMM.from_linear


@dataclass
class Layout:
    """A quantization method as its tool writes it: the tiles and the scales' names follow
    from ``quantization_config``."""

    quantization_config: dict[str, Any]
    # modules written unquantized although they are projections (the config's ignore list)
    unquantized: tuple[str, ...] = ()
    scale_dtype: torch.dtype = torch.float32  # float8 scales
    extra: dict[str, torch.Tensor] = field(default_factory=dict)  # written beside each weight

    @property
    def method(self) -> str:
        return self.quantization_config["quant_method"]

    def quantize(self, module: str, weight: torch.Tensor) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        if self.method == "awq":
            return awq(module, weight, self.quantization_config["group_size"])
        if self.method == "gptq":
            return gptq(module, weight, self.quantization_config["group_size"])
        return self._float8(module, weight)

    def _tile(self, rows: int, cols: int) -> tuple[int, int]:
        """The rows and columns one float8 scale covers."""
        if self.method == "fp8":
            block = self.quantization_config["weight_block_size"]
            return tuple(block) if block else (rows, cols)
        weights = self.quantization_config["config_groups"]["group_0"]["weights"]
        return {"tensor": (rows, cols), "channel": (1, cols)}.get(weights["strategy"]) or \
            tuple(weights["block_structure"])

    def _float8(self, module: str, weight: torch.Tensor) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        rows, cols = weight.shape
        tile = self._tile(rows, cols)
        grid = (-(-rows // tile[0]), -(-cols // tile[1]))
        amax = torch.zeros(grid)
        for i in range(grid[0]):
            for j in range(grid[1]):
                amax[i, j] = weight[i * tile[0]:(i + 1) * tile[0], j * tile[1]:(j + 1) * tile[1]].abs().max()
        scale = (amax / FLOAT8_MAX).to(self.scale_dtype)
        expanded = torch.zeros(rows, cols, dtype=self.scale_dtype)
        for i in range(grid[0]):
            for j in range(grid[1]):
                expanded[i * tile[0]:(i + 1) * tile[0], j * tile[1]:(j + 1) * tile[1]] = scale[i, j]
        quantized = (weight / expanded.float()).clamp(-FLOAT8_MAX, FLOAT8_MAX).to(FLOAT8)
        if self.method == "fp8":  # transformers: in fp32
            dequantized = quantized.float() * expanded.float()
        else:  # compressed-tensors: in the scales' dtype
            dequantized = (quantized.to(self.scale_dtype) * expanded).float()
        if tile == (rows, cols):
            scale = scale.reshape(1)  # llm-compressor writes a per-tensor scale as [1]
        scale_name = "weight_scale_inv" if self.method == "fp8" else "weight_scale"
        tensors = {f"{module}.weight": quantized, f"{module}.{scale_name}": scale}
        tensors.update({f"{module}.{name}": tensor.clone() for name, tensor in self.extra.items()})
        return tensors, dequantized


def _min_max_int4(weight: torch.Tensor,
                  zero_range: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Asymmetric 4-bit codes of ``weight`` [out, n] as one group per row: (codes, zero, scale
    in fp16), with ``weight ~= (codes - zero) * scale``."""
    low, high = weight.min(dim=1).values.clamp(max=0), weight.max(dim=1).values.clamp(min=0)
    scale = ((high - low) / 15).clamp(min=1e-5).half()
    zero = torch.round(-low / scale.float()).clamp(*zero_range)
    codes = torch.clamp(torch.round(weight / scale.float()[:, None]) + zero[:, None], 0, 15)
    return codes.long(), zero.long(), scale


def _as_int32(words: torch.Tensor) -> torch.Tensor:
    """Unsigned 32-bit words (held in int64) as the int32 a checkpoint stores."""
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def awq(module: str, weight: torch.Tensor, group_size: int) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """AutoAWQ GEMM: qweight [in, out/8] (columns packed in AWQ_PACK_ORDER), qzeros
    [in/g, out/8], scales [in/g, out] in fp16."""
    cols = weight.shape[1]
    codes, zeros, scales = [], [], []
    for start in range(0, cols, group_size):
        group_codes, group_zero, group_scale = _min_max_int4(weight[:, start:start + group_size], (0, 15))
        codes.append(group_codes)
        zeros.append(group_zero)
        scales.append(group_scale)
    codes = torch.cat(codes, dim=1)  # [out, in]
    zeros, scales = torch.stack(zeros, dim=1), torch.stack(scales, dim=1)  # [out, groups]
    group_of = torch.arange(cols) // group_size
    dequantized = ((codes - zeros[:, group_of]).half() * scales[:, group_of]).float()

    def pack_columns(values: torch.Tensor) -> torch.Tensor:  # [n, c] -> [n, c/8]
        words = torch.zeros(values.shape[0], values.shape[1] // 8, dtype=torch.int64)
        for column in range(words.shape[1]):
            for nibble, source in enumerate(AWQ_PACK_ORDER):
                words[:, column] |= values[:, column * 8 + source] << (4 * nibble)
        return _as_int32(words)

    return {f"{module}.qweight": pack_columns(codes.t()), f"{module}.qzeros": pack_columns(zeros.t()),
            f"{module}.scales": scales.t().contiguous()}, dequantized


def gptq(module: str, weight: torch.Tensor, group_size: int) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """GPTQ v1 with act-order: input channels quantized in a random order, g_idx naming each
    one's group; qweight [in/8, out] (rows packed in order), qzeros [groups, out/8] holding
    zero - 1, scales [groups, out] in fp16."""
    rows, cols = weight.shape
    order = torch.randperm(cols, generator=torch.Generator().manual_seed(cols))
    group_index = torch.empty(cols, dtype=torch.int32)
    group_index[order] = (torch.arange(cols) // group_size).to(torch.int32)
    codes = torch.empty(rows, cols, dtype=torch.long)
    zeros, scales = [], []
    for group in range(cols // group_size):
        members = (group_index == group).nonzero().flatten()
        # zero >= 1: v1 stores zero - 1, and AutoGPTQ's packing breaks on a stored -1
        group_codes, group_zero, group_scale = _min_max_int4(weight[:, members], (1, 15))
        codes[:, members] = group_codes
        zeros.append(group_zero)
        scales.append(group_scale)
    zeros, scales = torch.stack(zeros), torch.stack(scales)  # [groups, out]
    g = group_index.long()
    dequantized = (scales[g] * (codes.t() - zeros[g]).half()).t().float().contiguous()
    rows_in = codes.t()  # [in, out]
    qweight = torch.zeros(cols // 8, rows, dtype=torch.int64)
    for word in range(cols // 8):
        for nibble in range(8):
            qweight[word] |= rows_in[word * 8 + nibble] << (4 * nibble)
    stored = zeros - 1
    qzeros = torch.zeros(stored.shape[0], rows // 8, dtype=torch.int64)
    for word in range(rows // 8):
        for nibble in range(8):
            qzeros[:, word] |= stored[:, word * 8 + nibble] << (4 * nibble)
    return {f"{module}.qweight": _as_int32(qweight), f"{module}.qzeros": _as_int32(qzeros),
            f"{module}.scales": scales, f"{module}.g_idx": group_index}, dequantized


def is_listed(module: str, patterns: tuple[str, ...]) -> bool:
    return any(re.fullmatch(p[3:], module) if p.startswith("re:") else module == p for p in patterns)


def save_quantized_checkpoint(variant: str, layout: Layout, directory: Path, seed: int = 0):
    """A random ``variant`` model quantized in ``layout`` and saved in ``directory``; returns
    transformers' model of its dequantized weights, saved unquantized beside it (fp32, eval)."""
    import transformers

    float_directory = directory.parent / f"{directory.name}-float"
    save_random_hf_model(tiny_config(variant), float_directory, seed=seed)
    stored, dequantized = {}, {}
    for name, tensor in load_file(str(float_directory / "model.safetensors")).items():
        module = name.removesuffix(".weight")
        if (name.endswith(".weight") and module.rpartition(".")[2] in PROJECTIONS
                and not is_listed(module, layout.unquantized)):
            quantized, dequantized[name] = layout.quantize(module, tensor)
            stored.update(quantized)
        else:
            stored[name] = dequantized[name] = tensor
    config = json.loads((float_directory / "config.json").read_text())
    reference_directory = directory.parent / f"{directory.name}-dequantized"
    for target, tensors in ((reference_directory, dequantized), (directory, stored)):
        target.mkdir(parents=True)
        save_file(tensors, str(target / "model.safetensors"), metadata={"format": "pt"})
        (target / "config.json").write_text(json.dumps(config, indent=2))
        config = {**config, "quantization_config": layout.quantization_config}
    model = transformers.AutoModelForCausalLM.from_pretrained(reference_directory, dtype=torch.float32)
    return model.eval()
