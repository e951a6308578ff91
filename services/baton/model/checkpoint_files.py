"""The tensors of a checkpoint directory, by name, wherever their shard lies.

A directory holds ``model.safetensors`` or shards listed in ``model.safetensors.index.json``.
A quantized layer's tensors (a weight and its scales, or AWQ's packed ints) may sit in
different shards, so tensors are read by name through files opened once and kept open.
"""

from __future__ import annotations

import json
from pathlib import Path
from types import TracebackType
from typing import Self

import torch
from safetensors import safe_open

from baton.model.errors import CheckpointError


def weight_files(directory: Path) -> dict[str, Path]:
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


class CheckpointTensors:
    """Reads a checkpoint's tensors by name; use as a context manager (closes its files)."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.files = weight_files(directory)
        self._open: dict[Path, object] = {}

    def __enter__(self) -> Self:
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 traceback: TracebackType | None) -> None:
        for handle in self._open.values():
            handle.__exit__(None, None, None)
        self._open.clear()

    def __contains__(self, name: str) -> bool:
        return name in self.files

    def file_of(self, name: str) -> str:
        """The file an error about ``name`` should cite (a shard, or the one it would be in)."""
        path = self.files.get(name) or next(iter(self.files.values()), self.directory / "model.safetensors")
        return str(path)

    def read(self, name: str, start: int = 0, end: int | None = None) -> torch.Tensor:
        """Rows ``start:end`` of tensor ``name`` (all of it by default); raises
        CheckpointError when it is missing."""
        if name not in self.files:
            raise CheckpointError(self.file_of(name), name, "is missing")
        path = self.files[name]
        if path not in self._open:
            handle = safe_open(str(path), framework="pt")
            self._open[path] = handle.__enter__()
        handle = self._open[path]
        if start == 0 and end is None:
            return handle.get_tensor(name)
        return handle.get_slice(name)[start:end]
