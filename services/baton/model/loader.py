"""Loading and saving Hugging Face checkpoint directories.

A directory holds ``config.json``, the weights as ``model.safetensors`` or as
shards listed in ``model.safetensors.index.json``, and ``tokenizer.json``.
Every error names the file and the field at fault.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from baton.dtypes import DTYPES
from baton.model.config import ModelConfig
from baton.model.errors import CheckpointError
from baton.model.llama import CausalLM
from baton.model.probe import fastest_run_s
from baton.model.tokenizer import Tokenizer

SHIPPED_MODEL_DIR = Path(__file__).resolve().parents[3] / "models" / "baton-pystdlib"


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
    """``auto``: bfloat16 on CUDA; on a CPU, bfloat16 where its matmuls measure faster than
    fp32's (AVX512-BF16 and AMX CPUs: 3-10x on the development machines), else fp32."""
    if dtype == "auto":
        if device.type == "cuda":
            return torch.bfloat16
        return torch.bfloat16 if cpu_bfloat16_speedup() >= BFLOAT16_MIN_SPEEDUP else torch.float32
    return DTYPES[dtype]


# bf16 must pay clearly: it costs accuracy (a 8-bit mantissa), so a CPU that merely emulates
# it at fp32's speed keeps fp32.
BFLOAT16_MIN_SPEEDUP = 1.5


@functools.cache
def cpu_bfloat16_speedup() -> float:
    """fp32 time / bf16 time of a 512x1024x1024 matmul on this CPU (measured once, ~20 ms)."""
    timings = {}
    for dtype in (torch.float32, torch.bfloat16):
        a = torch.randn(512, 1024).to(dtype)
        b = torch.randn(1024, 1024).to(dtype)
        timings[dtype] = fastest_run_s(lambda a=a, b=b: a @ b, runs=3)
    return timings[torch.float32] / timings[torch.bfloat16]


def _weight_files(directory: Path) -> dict[str, Path]:
    """name -> file holding it."""
    single = directory / "model.safetensors"
    index = directory / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError) as e:
            raise CheckpointError(str(index), "weight_map", f"cannot be read: {e}") from e
        files = {name: directory / shard for name, shard in weight_map.items()}
        for shard in set(files.values()):
            if not shard.is_file():
                raise CheckpointError(str(index), "weight_map", f"names {shard.name}, which is missing")
        return files
    if single.is_file():
        with safe_open(str(single), framework="pt") as f:
            return {name: single for name in f.keys()}  # noqa: SIM118 (safe_open is not iterable)
    raise CheckpointError(str(directory), "model.safetensors",
                          "file not found (nor model.safetensors.index.json)")


def load_weights(model: CausalLM, directory: Path) -> None:
    files = _weight_files(directory)
    expected = dict(model.named_parameters())
    if model.config.tie_word_embeddings:
        expected.pop("lm_head.weight", None)
    by_file: dict[Path, list[str]] = {}
    for name in expected:
        if name not in files:
            source = files and next(iter(files.values())).name or "model.safetensors"
            raise CheckpointError(str(directory / source), name, "is missing")
        by_file.setdefault(files[name], []).append(name)
    for path, names in by_file.items():
        with safe_open(str(path), framework="pt") as f:
            for name in names:
                tensor = f.get_tensor(name)
                parameter = expected[name]
                if tuple(tensor.shape) != tuple(parameter.shape):
                    raise CheckpointError(str(path), name, f"has shape {tuple(tensor.shape)}, "
                                          f"expected {tuple(parameter.shape)}")
                with torch.no_grad():
                    parameter.copy_(tensor.to(parameter.dtype))


def load_checkpoint(path: str | Path = "", dtype: str = "auto", device: str = "auto",
                    revision: str = "", with_tokenizer: bool = True) -> LoadedModel:
    """Load a checkpoint directory (empty path = the shipped model) onto a device."""
    directory = Path(path) if path else SHIPPED_MODEL_DIR
    if not directory.is_dir():
        raise CheckpointError(str(directory), "directory", "does not exist")
    config = ModelConfig.from_file(directory / "config.json")
    target = resolve_device(device)
    with torch.device("meta"):
        model = CausalLM(config)
    model = model.to_empty(device=target).to(resolve_dtype(dtype, target))
    model.rotary = type(model.rotary)(config).to(target)
    load_weights(model, directory)
    if config.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    model.eval().fuse_projections()
    tokenizer = Tokenizer.from_dir(directory) if with_tokenizer else None
    return LoadedModel(model, config, tokenizer, model_id=directory.name,
                       revision=revision or directory.name, path=directory)


def save_checkpoint(model: CausalLM, directory: Path, dtype: torch.dtype = torch.float16) -> None:
    """Write ``config.json`` and ``model.safetensors`` in Hugging Face's layout."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(model.config.to_hf_dict(), indent=2) + "\n")
    tensors = {name: p.detach().to("cpu", dtype, copy=True) for name, p in model.named_parameters()}
    if model.config.tie_word_embeddings:
        tensors.pop("lm_head.weight", None)
    save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})
