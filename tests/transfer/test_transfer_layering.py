"""KV transfer sits between the pool and the pods: nothing in baton.transfer imports the
pods, the engines or the algorithms that serve above it, and baton.kv imports nothing of
transfer (the pool's side of it is baton.kv.landing)."""

from __future__ import annotations

import ast
from pathlib import Path

import baton.kv
import baton.transfer

ABOVE_TRANSFER = ("baton.decode", "baton.prefill", "baton.gateway", "baton.sarathi",
                  "baton.runahead", "baton.pyramid", "baton.local", "baton.commands")


def imports_of(package) -> list[tuple[str, str]]:
    found = []
    for path in Path(package.__file__).parent.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([alias.name for alias in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            found += [(path.name, name) for name in names]
    return found


def test_transfer_imports_nothing_from_the_pods_or_engines():
    assert [(f, n) for f, n in imports_of(baton.transfer) if n.startswith(ABOVE_TRANSFER)] == []


def test_the_pool_imports_nothing_of_transfer():
    assert [(f, n) for f, n in imports_of(baton.kv) if n.startswith("baton.transfer")] == []
