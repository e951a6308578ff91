"""Errors raised while loading a checkpoint: each names the file and the field at fault."""

from __future__ import annotations


class CheckpointError(ValueError):
    """A checkpoint directory that cannot be loaded (names the file and the field)."""

    def __init__(self, file: str, field: str, problem: str) -> None:
        super().__init__(f"{file}: {field} {problem}")
        self.file = file
        self.field = field
        self.problem = problem
