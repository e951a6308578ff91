"""The KV layer sits below the model: nothing in baton.kv imports baton.model (or anything
that serves above it), so the pool can be used and tested alone."""

from __future__ import annotations

import ast
from pathlib import Path

import baton.kv

FORBIDDEN = ("baton.model", "baton.sarathi", "baton.decode", "baton.prefill", "baton.gateway",
             "baton.runahead", "baton.pyramid")


def test_kv_modules_import_nothing_from_the_layers_above():
    offenders = []
    for path in Path(baton.kv.__file__).parent.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([alias.name for alias in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            offenders += [f"{path.name}: {name}" for name in names if name.startswith(FORBIDDEN)]
    assert offenders == []
