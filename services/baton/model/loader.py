"""Loading and saving Hugging Face checkpoint directories.

A directory holds ``config.json``, the weights as ``model.safetensors`` or as
shards listed in ``model.safetensors.index.json``, and ``tokenizer.json``. A quantized
checkpoint is dequantized as it loads (``baton.model.quantization``). Every error names
the file and the field at fault.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file

from baton.dtypes import DTYPES
from baton.model.checkpoint_files import CheckpointTensors
from baton.model.config import ModelConfig, read_config_json
from baton.model.errors import CheckpointError
from baton.model.hub import resolve_model
from baton.model.llama import CausalLM
from baton.model.quantization import QuantizedWeights, quantization_from_hf_dict, read_weight
from baton.model.sharding import Collectives, ShardLayout
from baton.model.tokenizer import Tokenizer
from baton.model.weight_names import checkpoint_source, checkpoint_tensors


@dataclass
class LoadedModel:
    model: CausalLM
    config: ModelConfig
    tokenizer: Tokenizer | None
    model_id: str
    revision: str
    path: Path


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    """``auto``: bfloat16 on CUDA, and on a CPU that multiplies bf16 in hardware
    (``cpu_has_fast_bfloat16``); fp32 elsewhere."""
    if dtype == "auto":
        if device.type == "cuda":
            return torch.bfloat16
        return torch.bfloat16 if cpu_has_fast_bfloat16() else torch.float32
    return DTYPES[dtype]


def cpu_has_fast_bfloat16() -> bool:
    """Does this CPU multiply bf16 in hardware (AVX512-BF16, or AMX)? oneDNN's bf16 matmuls
    then run several times fp32's; a CPU without either emulates bf16 at about fp32's
    speed, for an 8-bit mantissa. Read off the instruction set rather than timed: every
    process of a deployment must pick the same dtype (a chain's KV reaches the decode pods
    in its own, and a pod refuses another), and a timing taken while the other processes
    start can fall either side of any threshold (docs/runtime.md, "Precision")."""
    return bool(torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported())


def load_weights(model: CausalLM, directory: Path, quantization: QuantizedWeights | None = None) -> None:
    """Every parameter from the checkpoint in ``directory``, dequantized where ``quantization``
    stores it quantized, and cut to the model's shard (``ShardLayout.shard``)."""
    expected = dict(model.named_parameters())
    if model.config.tie_word_embeddings:
        expected.pop("lm_head.weight", None)
    with CheckpointTensors(directory) as tensors:
        for name, parameter in expected.items():
            source = checkpoint_source(model.config, name)
            tensor = model.layout.shard(name, read_weight(tensors, source, quantization, parameter.dtype))
            if tuple(tensor.shape) != tuple(parameter.shape):
                where = "" if source.name == name else f" (rows {source.start}:{source.end}, for {name})"
                raise CheckpointError(tensors.file_of(source.name), source.name + where, f"has shape "
                                      f"{tuple(tensor.shape)}, expected {tuple(parameter.shape)}")
            with torch.no_grad():
                parameter.copy_(tensor)


def load_checkpoint(path: str | Path = "", dtype: str = "auto", device: str = "auto",
                    revision: str = "", with_tokenizer: bool = True,
                    max_model_len: int = 0, group: Collectives | None = None) -> LoadedModel:
    """Load a checkpoint (a directory, empty for the shipped model, or a Hugging Face repo
    id: ``baton.model.hub``) onto a device; with a tensor-parallel ``group``, this rank's
    shard of it."""
    files = resolve_model(path, revision)
    directory = files.directory
    config = ModelConfig.from_file(directory / "config.json")
    quantization = quantization_from_hf_dict(read_config_json(directory / "config.json"),
                                             str(directory / "config.json"))
    config.cap_context(max_model_len)
    target = resolve_device(device)
    layout = ShardLayout(config, group.size, group.rank) if group is not None else None
    with torch.device("meta"):
        model = CausalLM(config, layout, group)
    model = model.to_empty(device=target).to(resolve_dtype(dtype, target))
    load_weights(model, directory, quantization)
    if config.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    model.eval().fuse_projections()
    tokenizer = Tokenizer.from_dir(directory) if with_tokenizer else None
    return LoadedModel(model, config, tokenizer, model_id=files.name, revision=files.revision,
                       path=directory)


def save_checkpoint(model: CausalLM, directory: Path, dtype: torch.dtype = torch.float16) -> None:
    """Write ``config.json`` and ``model.safetensors`` in Hugging Face's layout."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(model.config.to_hf_dict(), indent=2) + "\n")
    tensors = {name: p.detach().to("cpu", dtype, copy=True) for name, p in model.named_parameters()}
    if model.config.tie_word_embeddings:
        tensors.pop("lm_head.weight", None)
    tensors = checkpoint_tensors(model.config, tensors)
    save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})
