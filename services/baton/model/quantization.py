"""A checkpoint's ``quantization_config``: the methods that load, and the refusal of the rest.

baton computes every matmul in the model's dtype, so a quantized checkpoint is dequantized
as it is loaded (``baton.model.dequantize``): it loads with the memory and the speed of the
unquantized model, and with exactly the weights its quantization stored. Activation
quantization (a static ``input_scale``) and KV-cache scales are quantization of what the
model computes, not of its weights: they are not read, and activations and the KV cache
stay in the model's dtype.

Which layers are quantized is read off the checkpoint: a weight stored with its scales
(or, for AWQ and GPTQ, packed as ``qweight``) is dequantized; any other is read as it is,
and one stored in a one-byte or integer type is refused rather than cast (its scales are
missing, or the config lists its layer as unquantized). Layers the config leaves out
(``ignore``, ``modules_to_not_convert``) are read as they are.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from baton.model.checkpoint_files import CheckpointTensors
from baton.model.dequantize import dequantize_awq, dequantize_float8, dequantize_gptq
from baton.model.errors import CheckpointError
from baton.model.weight_names import TensorSlice

FIELD = "quantization_config"
COMPRESSED_TENSORS_FORMATS = ("float-quantized", "naive-quantized")
COMPRESSED_TENSORS_STRATEGIES = ("tensor", "channel", "block")
GPTQ_FORMATS = {"gptq": True, "gptq_v2": False}  # format -> zeros stored one less (v1)


class QuantizedWeights(Protocol):
    """How one quantization method stores a Linear's weight."""

    method: str

    def stores_quantized(self, tensors: CheckpointTensors, weight: str) -> bool:
        """Is the checkpoint's weight ``weight`` (a ``*.weight`` name) stored quantized?"""

    def dequantize(self, tensors: CheckpointTensors, weight: str, dtype: torch.dtype) -> torch.Tensor:
        """Its values in ``dtype``, ``[out_features, in_features]`` (ValueError if malformed)."""


def _module(weight: str) -> str | None:
    """``weight``'s module, when it is a weight (not a bias nor a norm's scale)."""
    return weight.removesuffix(".weight") if weight.endswith(".weight") else None


def _is_listed(module: str, patterns: tuple[str, ...]) -> bool:
    """Does ``module`` match one of an ignore list's entries? compressed-tensors' ``re:``
    regexes, or as transformers reads ``modules_to_not_convert``: a pattern matched from
    the start up to a module boundary, or a suffix."""
    for pattern in patterns:
        if pattern.startswith("re:"):
            if re.match(pattern[3:], module):
                return True
        elif re.match(rf"(?:{pattern})(?:(?<=\.)|(?=\.|$))", module) or module.endswith(pattern):
            return True
    return False


@dataclass(frozen=True)
class Float8Weights:
    """float8 weights beside their scales (``scale_suffix``), per tensor, per output channel or
    per ``block_size`` tile. ``compute_dtype`` None: multiplied in the scales' dtype."""

    method: str
    scale_suffix: str
    block_size: tuple[int, int] | None
    compute_dtype: torch.dtype | None
    unquantized: tuple[str, ...]

    def stores_quantized(self, tensors: CheckpointTensors, weight: str) -> bool:
        module = _module(weight)
        return (module is not None and not _is_listed(module, self.unquantized)
                and f"{module}.{self.scale_suffix}" in tensors)

    def dequantize(self, tensors: CheckpointTensors, weight: str, dtype: torch.dtype) -> torch.Tensor:
        quantized = tensors.read(weight)
        if quantized.is_floating_point() and quantized.element_size() == 1:
            scale = tensors.read(f"{_module(weight)}.{self.scale_suffix}")
            return dequantize_float8(quantized, scale, self.block_size, self.compute_dtype, dtype)
        raise ValueError(f"is stored as {quantized.dtype} beside its {self.scale_suffix}; "
                         f"{self.method} stores float8 weights")


def _stores_packed_int4(tensors: CheckpointTensors, weight: str) -> bool:
    module = _module(weight)
    return module is not None and f"{module}.qweight" in tensors


def _packed_int4(tensors: CheckpointTensors, module: str) -> list[torch.Tensor]:
    """AWQ's and GPTQ's packed ints, their zeros and their scales."""
    return [tensors.read(f"{module}.{name}") for name in ("qweight", "qzeros", "scales")]


@dataclass(frozen=True)
class AwqWeights:
    """AutoAWQ's GEMM layout: ``qweight``, ``qzeros``, ``scales``."""

    group_size: int
    method: str = "awq"

    def stores_quantized(self, tensors: CheckpointTensors, weight: str) -> bool:
        return _stores_packed_int4(tensors, weight)

    def dequantize(self, tensors: CheckpointTensors, weight: str, dtype: torch.dtype) -> torch.Tensor:
        return dequantize_awq(*_packed_int4(tensors, _module(weight)), group_size=self.group_size,
                              dtype=dtype)


@dataclass(frozen=True)
class GptqWeights:
    """GPTQ's layout: ``qweight``, ``qzeros``, ``scales`` and ``g_idx``."""

    group_size: int
    zeros_stored_minus_one: bool
    method: str = "gptq"

    def stores_quantized(self, tensors: CheckpointTensors, weight: str) -> bool:
        return _stores_packed_int4(tensors, weight)

    def dequantize(self, tensors: CheckpointTensors, weight: str, dtype: torch.dtype) -> torch.Tensor:
        module = _module(weight)
        packed = _packed_int4(tensors, module)
        group_index = tensors.read(f"{module}.g_idx") if f"{module}.g_idx" in tensors else None
        return dequantize_gptq(*packed, group_index, self.group_size, self.zeros_stored_minus_one, dtype)


def read_weight(tensors: CheckpointTensors, source: TensorSlice, quantization: QuantizedWeights | None,
                dtype: torch.dtype) -> torch.Tensor:
    """The rows ``source`` names, in ``dtype``: dequantized where stored quantized; a tensor in
    a one-byte or integer type without what dequantizes it is refused, never cast."""
    if quantization is not None and quantization.stores_quantized(tensors, source.name):
        try:
            full = quantization.dequantize(tensors, source.name, dtype)
        except ValueError as e:
            raise CheckpointError(tensors.file_of(source.name), source.name, str(e)) from e
        return full[source.start:source.end]
    tensor = tensors.read(source.name, source.start, source.end)
    if not tensor.is_floating_point() or tensor.element_size() == 1:
        method = quantization.method if quantization is not None else "none"
        raise CheckpointError(tensors.file_of(source.name), source.name,
                              f"is stored as {tensor.dtype} without the scales that give its values "
                              f"({FIELD}: {method}); casting it would load wrong weights")
    return tensor.to(dtype)


# --- config.json's quantization_config, method by method -----------------------------------


def _compressed_tensors(config: dict[str, Any], source: str) -> QuantizedWeights:
    formats = {config.get("format")} | {group.get("format") for _, group in _groups(config, source)}
    formats.discard(None)
    unsupported = formats - set(COMPRESSED_TENSORS_FORMATS)
    if unsupported or not formats:
        raise CheckpointError(source, f"{FIELD}.format", f"{sorted(unsupported) or None} of compressed-"
                              f"tensors is not supported; supported: {COMPRESSED_TENSORS_FORMATS} (float8)")
    for key in ("transform_config", "sparsity_config"):
        if config.get(key):  # rotations or sparse storage change what the weights mean
            raise CheckpointError(source, f"{FIELD}.{key}", "is not supported (compressed-tensors "
                                  "loads float8 weights with their scales, nothing more)")
    block_sizes = set()
    for name, group in _groups(config, source):
        weights = group.get("weights") or {}
        described = (weights.get("type"), weights.get("num_bits"), weights.get("symmetric", True))
        if described != ("float", 8, True):
            raise CheckpointError(source, f"{FIELD}.config_groups.{name}.weights",
                                  f"type {described[0]!r}, num_bits {described[1]!r}, symmetric "
                                  f"{described[2]!r} is not supported; supported: symmetric float 8-bit")
        if weights.get("strategy") not in COMPRESSED_TENSORS_STRATEGIES:
            raise CheckpointError(source, f"{FIELD}.config_groups.{name}.weights.strategy",
                                  f"{weights.get('strategy')!r} is not supported; "
                                  f"supported: {COMPRESSED_TENSORS_STRATEGIES}")
        if weights.get("strategy") == "block":
            block_sizes.add(tuple(_block_size(weights.get("block_structure"), source,
                                              f"config_groups.{name}.weights.block_structure")))
    if len(block_sizes) > 1:
        raise CheckpointError(source, f"{FIELD}.config_groups", f"mixes block sizes {sorted(block_sizes)}")
    return Float8Weights("compressed-tensors", "weight_scale", next(iter(block_sizes), None),
                         compute_dtype=None, unquantized=tuple(config.get("ignore") or ()))


def _groups(config: dict[str, Any], source: str) -> list[tuple[str, dict[str, Any]]]:
    groups = config.get("config_groups")
    if not isinstance(groups, dict) or not groups:
        raise CheckpointError(source, f"{FIELD}.config_groups", "is missing")
    return list(groups.items())


def _fp8(config: dict[str, Any], source: str) -> QuantizedWeights:
    block = config.get("weight_block_size")
    return Float8Weights("fp8", "weight_scale_inv",
                         None if block is None else _block_size(block, source, "weight_block_size"),
                         compute_dtype=torch.float32,
                         unquantized=tuple(config.get("modules_to_not_convert") or ()))


def _block_size(value: Any, source: str, field: str) -> tuple[int, int]:
    if not (isinstance(value, list | tuple) and len(value) == 2
            and all(isinstance(v, int) and v > 0 for v in value)):
        raise CheckpointError(source, f"{FIELD}.{field}", f"must be two positive integers, got {value!r}")
    return (value[0], value[1])


def _check_int4(config: dict[str, Any], source: str, method: str) -> None:
    if config.get("bits") != 4:
        raise CheckpointError(source, f"{FIELD}.bits", f"{config.get('bits')!r} of {method} is not "
                              "supported; supported: 4")
    if not isinstance(config.get("group_size"), int):
        raise CheckpointError(source, f"{FIELD}.group_size",
                              f"must be an integer, got {config.get('group_size')!r}")


def _awq(config: dict[str, Any], source: str) -> QuantizedWeights:
    _check_int4(config, source, "awq")
    version = str(config.get("version", "gemm")).lower()
    backend = str(config.get("backend") or "autoawq").lower()
    if version != "gemm" or backend != "autoawq" or not config.get("zero_point", True):
        raise CheckpointError(source, FIELD, f"awq version {version!r}, backend {backend!r}, zero_point "
                              f"{config.get('zero_point', True)!r} is not supported; supported: "
                              "AutoAWQ's gemm layout with zero points")
    return AwqWeights(config["group_size"])


def _gptq(config: dict[str, Any], source: str) -> QuantizedWeights:
    _check_int4(config, source, "gptq")
    layout = config.get("checkpoint_format") or config.get("format") or "gptq"
    if layout not in GPTQ_FORMATS:
        raise CheckpointError(source, f"{FIELD}.checkpoint_format", f"{layout!r} is not supported; "
                              f"supported: {sorted(GPTQ_FORMATS)}")
    return GptqWeights(config["group_size"], zeros_stored_minus_one=GPTQ_FORMATS[layout])


METHODS: dict[str, Callable[[dict[str, Any], str], QuantizedWeights]] = {
    "compressed-tensors": _compressed_tensors,
    "fp8": _fp8,
    "awq": _awq,
    "gptq": _gptq,
}


def quantization_from_hf_dict(data: dict[str, Any], source: str = "config.json") -> QuantizedWeights | None:
    """config.json's quantization (None: unquantized); CheckpointError for a method baton
    does not load, naming it and the supported ones."""
    config = data.get(FIELD)
    if config is None:
        return None
    method = config.get("quant_method") if isinstance(config, dict) else None
    if method not in METHODS:
        raise CheckpointError(source, f"{FIELD}.quant_method", f"{method!r} is not supported; "
                              f"supported: {sorted(METHODS)} (dequantized at load)")
    return METHODS[method](config, source)
